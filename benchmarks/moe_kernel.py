"""The fused MoE kernel alone (atomc.kernels.triton.moe.fused_experts: routing excluded) at M = 1, 8,
64, 512, 4096 tokens for Mixtral-8x7B, Qwen3-30B-A3B and GPT-OSS-20B shapes, bf16, random weights,
next to atomc's per-expert torch loop (`experts_reference`) and `torch._grouped_mm` (where the
torch build has it).

    python benchmarks/moe_kernel.py --out results/moe_kernel.json [--shapes mixtral,qwen3_moe] [--tokens 1,8] [--routes]
    python benchmarks/moe_kernel.py --weights mxfp4 --shapes gpt_oss --out results/moe_kernel_mxfp4.json
    python benchmarks/moe_kernel.py --weights mxfp4 --shapes gpt_oss --tiny   # CPU, TRITON_INTERPRET=1, toy sizes

`--weights mxfp4 | fp8_channel | fp8_block`: the experts are quantised to that format (MXFP4 by
models/quant/mxfp4.py, FP8 by amax / 448 per row or per 128x128 block) and every bf16 row runs
their dequantised values (the same model); the row `atomc_triton_<format>` is the quantised
kernels (atomc/kernels/triton/moe_quant.py), whose bytes are the quantised weights and scales.
With MXFP4 or per-row FP8 at one token (MXFP4: up to moe_config.GEMV_MAX_TOKENS),
`atomc_triton_<format>[fp32]` and `[packed_f16]` are the GEMV route on each of its loops (the fp32
step; the packed-f16 one of atomc/kernels/triton/mxfp4_packed.py, moe_gemv.py: the tile knob
`packed_f16`), whatever the default picks; `[gemv,fp32]` / `[gemv,packed_f16]` where the picked
route is another (a tuned file's tensor-core route, or the small route past one token). FP8 experts
on few pairs also get `[small,a8]`: the small route with its activations quantised to e4m3 in the
kernels (the tile knob `a8`, a W8A8 kernel: its err against the W8A16 reference is the activation
quantisation's).

Bytes are the weights actually read (the distinct experts the routing touches, w13 + w2 + biases)
plus x and the output; FLOPs are 6 * M * top_k * H * I. Ours and grouped_mm are timed as CUDA-graph
replays of R back-to-back calls, each with its own random routing, so consecutive calls touch
different experts and the weights come from HBM (not L2) as in a model, which streams every
layer between two uses of one layer's experts; the torch loop syncs the host (it lists the experts
hit) and gets do_bench, L2 flushed. Each implementation is checked against the reference first.
`--tiny` runs the same code on the CPU under TRITON_INTERPRET=1 in fp32 at toy sizes (8 experts,
hidden and intermediate 64; wall-clock times, a smoke test before GPU time). The JSON is rewritten
after every shape.
"""

from __future__ import annotations

import os
import sys

if "--tiny" in sys.argv:  # before triton and atomc are imported: they read it at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import ceilings  # noqa: E402
import graph_timing  # noqa: E402
import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from atomc.kernels.triton import moe_config  # noqa: E402
from atomc.kernels.triton.moe import fused_experts  # noqa: E402
from atomc.kernels.triton.tuned_files import tile_device  # noqa: E402
from atomc.ops.moe import apply_activation, experts_reference, select_experts  # noqa: E402
from atomc.ops.moe_quant import WEIGHT_FORMATS  # noqa: E402

PEAK_GBPS = ceilings.local_copy_gbps()
BF16 = torch.bfloat16  # the activation dtype (--tiny: float32, the interpreter has no bf16)
DEV = "cuda"
# name: (experts, hidden, intermediate, top_k, activation, biases)
SHAPES = {
    "mixtral": (8, 4096, 14336, 2, "silu", False),
    "qwen3_moe": (128, 2048, 768, 8, "silu", False),
    "gpt_oss": (32, 2880, 2880, 4, "swiglu_oai", True),
    # the routed experts of DeepSeek-V2-Lite and V3 (their shared experts are dense MLPs beside)
    "deepseek_v2_lite": (64, 2048, 1408, 6, "silu", False),
    "deepseek_v3": (256, 7168, 2048, 8, "silu", False),
}
TOKENS = (1, 8, 64, 512, 4096)
REL_OK = 2e-2  # tests/kernels/test_triton_moe_quant_gpu.py's bound (bf16 activations, other sum orders)
REL_OK_A8 = 1e-1  # e4m3 activations: each input value off by up to 2^-4 relative, twice (3-5e-2 seen)
# --tiny: (experts, hidden, intermediate, top_k, activation, biases); tokens for the gemv, small and
# sorted routes
TINY_SHAPES = {
    "mixtral": (8, 64, 64, 2, "silu", False),
    "qwen3_moe": (8, 128, 128, 4, "silu", False),  # fp8_block needs whole 128-blocks to be exact
    "gpt_oss": (8, 64, 64, 2, "swiglu_oai", True),
    "deepseek_v2_lite": (8, 128, 128, 3, "silu", False),
    "deepseek_v3": (16, 128, 128, 4, "silu", False),
}
TINY_TOKENS = (1, 3, 40)


def wall_us(fn, reps: int = 3) -> float:
    """--tiny: median wall-clock µs of one call (a smoke value)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def quantize_experts(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked [E, N, K] experts in atomc::moe_quant's `fmt` layout (amax scaling, round to nearest),
    an expert at a time: DeepSeek-V3's stacked gate/up in fp32 at once is 28 GiB."""
    if w.shape[0] > 1:
        parts = [quantize_experts(w[i : i + 1], fmt) for i in range(w.shape[0])]
        return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])
    if fmt == "mxfp4":
        from models.quant.mxfp4 import quantize_mxfp4

        return quantize_mxfp4(w)
    if fmt == "fp8_channel":
        s = w.float().abs().amax(-1).clamp(min=1e-8) / 448
        return (w.float() / s[..., None]).to(torch.float8_e4m3fn), s
    e, n, k = w.shape  # fp8_block: 128x128 blocks, partial ones at the edges
    nb, kb = -(-n // 128), -(-k // 128)
    padded = torch.zeros(e, nb * 128, kb * 128, device=w.device)
    padded[:, :n, :k] = w.float()
    s = padded.unflatten(1, (nb, 128)).unflatten(3, (kb, 128)).abs().amax((2, 4)).clamp(min=1e-8) / 448
    full = s.repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)[:, :, :k]
    return (w.float() / full).to(torch.float8_e4m3fn), s


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def grouped_mm_moe(x, weights, ids, w13, w2, b13, b2, activation):
    """The MoE through torch._grouped_mm: pairs sorted by expert on the device, two grouped GEMMs,
    a weighted index_add (biases added per pair row). No host sync: graph-capturable."""
    t, k = ids.shape
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(w13.shape[0], dtype=torch.long, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)  # (bincount would sync the host to size its output)
    xs = x[order // k]
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs)
    if b13 is not None:
        h = h + b13[flat[order]]
    y = torch._grouped_mm(apply_activation(h, activation, 1.702, 7.0), w2.transpose(1, 2), offs)
    if b2 is not None:
        y = y + b2[flat[order]]
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, order // k, y.float() * weights.reshape(-1)[order, None])
    return out.to(x.dtype)


def graph_time_us(fn, calls: list[tuple]) -> float:
    """Median µs of one call, from replays of a graph holding every call in `calls` back to back
    (graph_timing.py); --tiny: the wall time of the calls, after one warm-up."""
    if DEV == "cpu":
        for args in calls:
            fn(*args)
        return wall_us(lambda: [fn(*args) for args in calls]) / len(calls)
    return graph_timing.graph_time_us(fn, calls)


def bench_shape(
    name: str, tokens: list[int], rows: list[dict], routes: bool = False, weights_fmt: str = "bf16"
) -> None:
    e, h, inter, k, act, bias = SHAPES[name]
    g = torch.Generator(DEV).manual_seed(0)
    w13 = (torch.randn(e, 2 * inter, h, generator=g, device=DEV) / h**0.5).to(BF16)
    w2 = (torch.randn(e, h, inter, generator=g, device=DEV) / inter**0.5).to(BF16)
    b13 = (0.5 * torch.randn(e, 2 * inter, generator=g, device=DEV)).to(BF16) if bias else None
    b2 = (0.5 * torch.randn(e, h, generator=g, device=DEV)).to(BF16) if bias else None
    expert_bytes = (3 * h * inter + (3 * h if bias else 0)) * 2
    if weights_fmt != "bf16":
        from atomc.kernels.triton.moe_quant import fused_experts_quant
        from atomc.ops.moe_quant import dequantize_experts

        (q13, s13), (q2, s2) = quantize_experts(w13, weights_fmt), quantize_experts(w2, weights_fmt)
        # every bf16 row runs the dequantised experts: the same model
        del w13, w2  # an expert at a time (fp32 temporaries of V3's stacked experts would not fit)
        w13, w2 = (torch.cat([dequantize_experts(q[i : i + 1], s[i : i + 1], weights_fmt, BF16) for i in range(e)])
                   for q, s in ((q13, s13), (q2, s2)))  # fmt: skip
        per_value = 0.5 + 1 / 32 if weights_fmt == "mxfp4" else 1 + (4 / 128 if weights_fmt == "fp8_channel" else 0)
        q_bytes = 3 * h * inter * per_value + (3 * h * 2 if bias else 0)
    for t in tokens:
        reps = 2 if DEV == "cpu" else 8 if t <= 64 else 2
        calls = []
        for _ in range(reps):
            x = torch.randn(t, h, generator=g, device=DEV).to(BF16)
            weights, ids = select_experts(torch.randn(t, e, generator=g, device=DEV), k)
            calls.append((x, weights, ids))
        touched = sum(ids.unique().numel() for _, _, ids in calls) / reps
        flops = 6 * t * k * h * inter
        x, weights, ids = calls[0]
        ref = experts_reference(x, weights, ids, w13, w2, b13, b2, None, act, 1.702, 7.0)
        dev = tile_device(x.device)
        cfg = moe_config.pick_config(t, e, h, inter, k, BF16, dev.name, family=dev.family)
        qcfg = moe_config.pick_config(t, e, h, inter, k, BF16, dev.name, weight_format=weights_fmt, family=dev.family)
        impls = {
            "atomc_triton": (lambda x, w, i: fused_experts(x, w, i, w13, w2, b13, b2, None, act), True),
            "torch_loop": (lambda x, w, i: experts_reference(x, w, i, w13, w2, b13, b2, None, act, 1.702, 7.0), False),
        }
        if weights_fmt != "bf16":
            impls[f"atomc_triton_{weights_fmt}"] = (
                lambda x, w, i: fused_experts_quant(x, w, i, q13, s13, q2, s2, b13, b2, None, act, 1.702, 7.0,
                                                    weights_fmt),
                True,
            )  # fmt: skip
        if weights_fmt in moe_config.PACKED_GEMV and moe_config.fits("gemv", t, k, weights_fmt):  # both loops
            gemv = qcfg if qcfg["path"] == "gemv" else moe_config.default_config(1, k, e, inter, weights_fmt)
            if gemv["path"] != "gemv":  # FP8's one-token default is the small route: the GEMVs' default tiles
                gemv = moe_config.default_config(1, k, e, inter)
            for packed in (False, True):
                variant = {**gemv, "gate_up": {**gemv["gate_up"], "packed_f16": packed},
                           "down": {**gemv["down"], "packed_f16": packed}}  # fmt: skip
                route = "[" if qcfg["path"] == "gemv" else "[gemv,"
                label = f"{route}{'packed_f16' if packed else 'fp32'}]"
                impls[f"atomc_triton_{weights_fmt}{label}"] = (
                    lambda x, w, i, c=variant: fused_experts_quant(x, w, i, q13, s13, q2, s2, b13, b2, None, act,
                                                                   1.702, 7.0, weights_fmt, config=c),
                    True,
                )  # fmt: skip
        if weights_fmt in ("fp8_channel", "fp8_block") and t * k <= moe_config.SMALL_PATH_MAX_PAIRS:
            # the small route with e4m3 activations (`a8`: a W8A8 kernel, so its err is the activation
            # quantisation's against this W8A16 reference, a few 1e-2, not a failure of the kernel)
            a8 = {"block_k": 128, "a8": True}
            small = moe_config.FP8_ONE_TOKEN
            variant = {"path": "small", "gate_up": {**small["gate_up"], **a8}, "down": {**small["down"], **a8}}
            impls[f"atomc_triton_{weights_fmt}[small,a8]"] = (
                lambda x, w, i, c=variant: fused_experts_quant(x, w, i, q13, s13, q2, s2, b13, b2, None, act, 1.702,
                                                               7.0, weights_fmt, config=c),
                True,
            )  # fmt: skip
        if hasattr(torch, "_grouped_mm"):
            impls["grouped_mm"] = (lambda x, w, i: grouped_mm_moe(x, w, i, w13, w2, b13, b2, act), True)
        if routes:  # every other route that can take t tokens, at its default tiles: where each wins
            for path, tokens_like in (("gemv", 1), ("small", 2), ("sorted", 4096)):
                if path != cfg["path"] and moe_config.fits(path, t, k):
                    alt = moe_config.default_config(tokens_like, k, e, inter)
                    fn = lambda x, w, i, alt=alt: fused_experts(x, w, i, w13, w2, b13, b2, None, act, config=alt)  # noqa: E731
                    impls[f"atomc_triton[{path}]"] = (fn, True)
        for impl, (fn, graphed) in impls.items():
            if impl.startswith(f"atomc_triton_{weights_fmt}") and weights_fmt != "bf16":  # quantised weights + scales
                nbytes = touched * q_bytes + 2 * t * h * 2
            else:
                nbytes = touched * expert_bytes + 2 * t * h * 2
            row = dict(shape=name, tokens=t, impl=impl, experts_touched=round(touched, 2), bytes=int(nbytes))
            try:
                row["rel_err"] = rel_err(fn(x, weights, ids), ref)
                row["ok"] = row["rel_err"] < (REL_OK_A8 if impl.endswith(",a8]") else REL_OK)
                if graphed:
                    us = graph_time_us(fn, calls)
                else:
                    once = lambda fn=fn, a=calls[0]: fn(*a)  # noqa: E731
                    us = wall_us(once) if DEV == "cpu" else do_bench(once, warmup=3, rep=30, return_mode="median") * 1e3
            except Exception as exc:  # e.g. grouped_mm on a GPU or dtype it does not support
                row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                print(f"{name:10s} M={t:5d} {impl:13s} failed: {row['error']}")
                rows.append(row)
                continue
            row.update(us=round(us, 2), gbps=round(nbytes / us / 1e3, 1), tflops=round(flops / us / 1e6, 2))
            row["pct_peak_bw"] = round(100 * row["gbps"] / PEAK_GBPS, 1)
            if impl == "atomc_triton":
                row["route"] = cfg["path"]
            elif impl.startswith(f"atomc_triton_{weights_fmt}"):
                row["route"] = ("small" if "small" in impl else "gemv") if "[" in impl else qcfg["path"]
            rows.append(row)
            print(f"{name:10s} M={t:5d} {impl:13s} {us:9.1f} us {row['gbps']:8.1f} GB/s ({row['pct_peak_bw']:5.1f}%) "
                  f"{row['tflops']:7.2f} TFLOP/s  err {row['rel_err']:.1e} {row.get('route', '')}"
                  f"{'' if row['ok'] else '  CHECK FAILED'}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("results/moe_kernel.json"))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--routes", action="store_true", help="also time each other route that can take M tokens")
    ap.add_argument("--weights", choices=("bf16", *WEIGHT_FORMATS), default="bf16", help="expert weight format")
    ap.add_argument("--tiny", action="store_true", help="toy sizes on the CPU under TRITON_INTERPRET=1, fp32")
    args = ap.parse_args()
    global DEV, BF16
    if args.tiny:
        DEV, BF16 = "cpu", torch.float32
        SHAPES.update(TINY_SHAPES)
        if args.tokens == ",".join(map(str, TOKENS)):
            args.tokens = ",".join(map(str, TINY_TOKENS))
    tokens = [int(t) for t in args.tokens.split(",")]
    rows: list[dict] = []
    meta = dict(gpu=torch.cuda.get_device_name() if DEV == "cuda" else "cpu (TRITON_INTERPRET=1)",
                torch=torch.__version__, python=platform.python_version(), weights=args.weights)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.shapes.split(","):
        bench_shape(name, tokens, rows, args.routes, args.weights)
        if DEV == "cuda":
            torch.cuda.empty_cache()  # the shape's weights are gone with its frame
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))  # what finished, so far
    print(f"wrote {args.out}")
    # a peer that cannot run here (grouped_mm on some builds) is a row, not a failure
    bad = [r for r in rows if r["impl"].startswith("atomc") and ("error" in r or not r.get("ok", True))]
    print(f"{len(rows)} rows, {len(bad)} atomc rows failed" + "".join(f"\n  {r}" for r in bad))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
