"""FP8 linears against bf16 on an H200: Llama-3.1-8B shapes (per-tensor and per-channel weights, the
batch-1 GEMV) and DeepSeek-V3 shapes (128x128 block-scaled weights at prefill sizes), torch._scaled_mm
next to atomc's Triton FP8 GEMM / GEMV (atomc/kernels/triton/fp8_*.py).

    python benchmarks/fp8_linear.py --out results/fp8_linear.json [--rep-ms 20]
        [--sweep [--configs-out DIR] [--sweep-budget-s S] [--sweep-row-budget-s S] [--sweep-schemes channel,block]]
        [--shapes qkv,o,gate_up,down] [--tokens 1,8,64,512,4096]
        [--dsv3-shapes q_b,kv_b,o,gate_up,down] [--dsv3-tokens 2048,4096]
    python benchmarks/fp8_linear.py --tiny   # the same code on the CPU (Triton interpreter, toy shapes)

Rows per (shape, M), each implementation checked against the dequantising reference first (a failed
check or a kernel that raises is a row with `error`, and the run goes on):
- `bf16`: F.linear on bf16 weights (cuBLAS), what atomc runs unquantised;
- `scaled_mm tensor` / `scaled_mm row`: torch._scaled_mm, per-tensor scales / per-token x
  per-channel (rowwise), what atomc's fp8_gemm runs above one row (row scales: above
  UNIT_SCALE_MAX_ROWS);
- `scaled_mm unit+epilogue` (per-channel weights, M >= 2): tensorwise torch._scaled_mm with unit
  scales into fp32, then atomc's Triton scale epilogue (`scaled_mm_unit`), what fp8_gemm runs with
  row scales at 2..UNIT_SCALE_MAX_ROWS rows (atomc/kernels/triton/fp8.py); its `engine_route` is the
  route fp8_gemm takes at that M, so the rows beside `scaled_mm row` show where the threshold belongs;
- `triton row` / `triton block`: the Triton FP8 GEMM, per-token x per-channel / 1x128 x 128x128;
- `scaled_mm block` (DeepSeek-V3 shapes): torch._scaled_mm with the 1x128 x 128x128 recipe
  (cuBLASLt, sm_90; atomc's `scaled_mm_block`), a row with `skipped` where it does not run;
- `gemv tensor|channel|block` (M = 1 only): the Triton FP8 GEMV, what atomc runs at batch 1;
- `quant token` / `quant group`: the activation quant kernel alone at this M (what a linear whose
  quant was not fused into a norm or SiLU pays on top of its GEMM).
Llama shapes run every scheme; DeepSeek-V3 shapes (`dsv3 *`) run bf16, `scaled_mm tensor` (the
issue's yardstick for the block GEMM), `triton block` and `scaled_mm block` (plus the block GEMV at
M = 1). Their block rows carry `engine_route`: what atomc's fp8_block_gemm runs for that call
(`pick_gemm`, and "triton" where cuBLAS declines), so `--dsv3-tokens` at small M shows where
CUBLAS_BLOCK_MIN_ROWS (atomc/kernels/triton/fp8.py) belongs.
The GEMM rows take an already quantised activation, as atomc's fp8_gemm does.

Timing: CUDA-graph replays of back-to-back calls over enough copies of the weight (>= 320 MiB in
all) that none is in L2, as in a model, which streams every other layer between two uses of one
weight; the median µs of one call. `pct_hbm` = bytes (weight + x + out, each read or written once)
/ µs against the GPU's copy rate (`ceilings.copy_gbps`, as kernels_bench.py); `pct_fp8_peak` /
`pct_bf16_peak` = FLOPs / µs against the dense peak (989 TFLOP/s bf16, 1,979 fp8);
`pct_roofline` takes the larger of the two times, so it is the share of what the shape allows.
The JSON (rewritten after every (shape, M), so a crash or a timeout keeps what finished) ends with
`targets`: per shape at M = 1 the FP8 GEMV's speed-up over bf16 (batch-1 decode reads half
the bytes: at most 2x), and per DeepSeek-V3 shape at M >= 2048 the block GEMM's share of the FP8
peak (target >= 70%) and its time against _scaled_mm per-tensor: `route`, `pct_fp8_peak`,
`meets_70pct` and `time_vs_scaled_mm` for the kernel the engine runs there, and `triton_*` /
`cublas_*` for both.

`--sweep` also times candidate tiles for every Triton row it runs (the GEMM's: 128x128 / 128x256 /
256x128 and smaller, 4 or 8 warps, 3-5 stages, pointer or tensor-descriptor (TMA) loads; the
GEMV's: the tensor-core kernel's rows a program, K step, depth and split-K, and the CUDA-core
kernel's; per-tensor GEMV rows time the default only, the per-channel sweep stands for both),
keeps the fastest that passes the check, and writes the winners into the tile table the kernels
read (atomc/kernels/triton/fp8_config.py; `--configs-out DIR`, default the package's
configs/fp8/, merged into the device's file), keyed by (N, K) and M. A row's `config` is the
winner, `default_us` the default's time. `--sweep-budget-s` stops trying new candidates after that
long (the default tiles are always timed), so a device call ends with a file;
`--sweep-row-budget-s` caps each row's candidates, so later shapes get their turn, and
`--sweep-schemes channel` sweeps only the per-channel rows (the others time their default). One call: the
DeepSeek-V3 block GEMM sweep (`--shapes '' --sweep`), another the batch-1 GEMV sweep (`--tokens 1
--dsv3-shapes '' --sweep`).
"""

from __future__ import annotations

import os
import sys

if "--tiny" in sys.argv:  # before triton and atomc are imported: they read it at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import ceilings  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

from atomc import compat  # noqa: E402
from atomc.kernels.triton import fp8 as backend  # noqa: E402
from atomc.kernels.triton import fp8_config, fp8_quant, tuned_files  # noqa: E402
from atomc.kernels.triton import fp8_gemm as gemm_mod  # noqa: E402
from atomc.kernels.triton import fp8_gemv as gemv_mod  # noqa: E402
from atomc.kernels.triton.fp8_gemm import fp8_gemm  # noqa: E402
from atomc.kernels.triton.fp8_gemv import fp8_gemv  # noqa: E402
from atomc.ops import fp8 as ref  # noqa: E402

PEAK_GBPS = ceilings.local_copy_gbps()
PEAK_TFLOPS = {"bf16": 989.0, "fp8": 1979.0}
COLD_BYTES = 320 * 2**20
FP8 = torch.float8_e4m3fn
# Llama-3.1-8B, one GPU: (N, K); the default --shapes
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LLAMA_DEFAULT = ",".join(SHAPES)
# the one-row dense linears of the MoE models `--quantization fp8` serves (their configs in
# checkpoints.py), with no tuned entry until swept: `--shapes qwen3_qkv,qwen3_o,...`
SHAPES.update({
    "qwen3_qkv": (5120, 2048), "qwen3_o": (2048, 4096),  # Qwen3-30B-A3B: 32 + 2 x 4 heads of 128, hidden 2048
    "v2lite_q_kv_a": (3648, 2048),  # DeepSeek-V2-Lite: q (16 heads x 192) and kv_a (512 + 64) as one GEMM
    "v2lite_o": (2048, 2048), "v2lite_shared_gate_up": (5632, 2048), "v2lite_shared_down": (2048, 2816),
})  # fmt: skip
# DeepSeek-V3 / R1 (hidden 7168, q_lora 1536, kv_lora 512, 128 heads of 128 + 64 rope, dense MLP
# 18432 in its first 3 layers): the block-FP8 linears as the checkpoint ships them, one GPU
DSV3_SHAPES = {
    "q_a": (1536, 7168), "q_b": (24576, 1536), "kv_a": (576, 7168), "kv_b": (32768, 512),
    "o": (7168, 16384), "gate_up": (36864, 7168), "down": (7168, 18432),
}  # fmt: skip
DSV3_DEFAULT = "q_b,kv_b,o,gate_up,down"
TOKENS = (1, 8, 64, 512, 4096)
DSV3_TOKENS = (2048, 4096)
# --tiny: toy shapes (K a multiple of 128 for the block kernels), a partial 128-row block in one
TINY_SHAPES = {"qkv": (192, 128), "down": (128, 256)}
TINY_DSV3_SHAPES = {"kv_a": (160, 256)}
TINY_TOKENS, TINY_DSV3_TOKENS = (1, 5), (33,)
ROWS: list[dict] = []
DEV, ACT = "cuda", torch.bfloat16  # --tiny: cpu, float32 (the interpreter has no bf16)
REP_MS = 20
BLOCK_TARGET_M = 2048  # the block GEMM's target holds from this M (--tiny: every M)
FOUND: dict = {}  # --sweep: {kernel: {(n, k): {m: config}}}, written into the tile table
SWEEP_DEADLINE = float("inf")  # time.monotonic() after which --sweep tries no new candidates
ROW_BUDGET_S = float("inf")  # --sweep-row-budget-s: the most one row's candidates may take
SWEEP_SCHEMES = ("channel", "block")  # --sweep-schemes: the weight schemes whose tiles are swept


def rel_err(out, want) -> float:
    return ((out.float() - want.float()).norm() / want.float().norm()).item()


def per_call_us(fn, weights: list) -> float:
    """Median µs of one call from a graph of calls over every weight copy in turn."""
    fn(weights[0])
    if DEV == "cpu":  # --tiny: wall clock, a smoke value
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            for w in weights:
                fn(w)
            times.append((time.perf_counter() - t0) / len(weights))
        return statistics.median(times) * 1e6
    torch.cuda.synchronize()
    return do_bench_cudagraph(lambda: [fn(w) for w in weights], rep=REP_MS, return_mode="median") * 1e3 / len(weights)


def record(shape, m, impl, us, nbytes, flops, kind, **extra) -> dict:
    t_bw = nbytes / (PEAK_GBPS * 1e9) * 1e6
    t_flop = flops / (PEAK_TFLOPS[kind] * 1e12) * 1e6
    row = dict(
        shape=shape, m=m, impl=impl, us=round(us, 2), pct_hbm=round(100 * t_bw / us, 1),
        **{f"pct_{kind}_peak": round(100 * t_flop / us, 1)},
        pct_roofline=round(100 * max(t_bw, t_flop) / us, 1), tflops=round(flops / us / 1e6, 1), **extra,
    )  # fmt: skip
    ROWS.append(row)
    flag = "" if row.get("ok", True) else f"  CHECK FAILED (rel err {row.get('rel_err')})"
    print(
        f"{shape:13s} M={m:5d} {impl:23s} {us:9.2f} us  {row['pct_hbm']:6.1f}% HBM  "
        f"{row[f'pct_{kind}_peak']:6.1f}% {kind} peak  {row['pct_roofline']:6.1f}% roofline{flag}",
        flush=True,
    )
    return row


def record_error(shape, m, impl, exc: BaseException) -> None:
    msg = f"{type(exc).__name__}: {str(exc)[:400]}"
    ROWS.append(dict(shape=shape, m=m, impl=impl, error=msg, trace=traceback.format_exc()[-1500:]))
    print(f"{shape:13s} M={m:5d} {impl:23s} FAILED {msg}", flush=True)


def copies(nbytes: int) -> int:
    return max(2, -(-COLD_BYTES // nbytes)) if DEV != "cpu" else 2


def weights_fp8(n, k, count, scheme):
    out = []
    for i in range(count):
        g = torch.Generator(DEV).manual_seed(i)
        w = (torch.randn(n, k, device=DEV, generator=g) * 64).clamp(-448, 448).to(FP8)
        if scheme == "tensor":
            s = torch.rand(1, device=DEV, generator=g) / 50
        elif scheme == "channel":
            s = torch.rand(n, device=DEV, generator=g) / 50
        else:
            s = torch.rand(-(-n // 128), k // 128, device=DEV, generator=g) / 50
        out.append((w, s))
    return out


def checked(out, want) -> dict:
    err = rel_err(out, want)
    return dict(rel_err=round(err, 5), ok=err < 1e-2)


def timed_best(fn_for, weights, want, configs):
    """(µs, config, check, default µs) of the fastest config (configs[0] is None: the default, always
    timed, its time kept even when its check fails, flagged ok=False). A candidate that fails the
    check, does not compile or raises is left out; none is tried after SWEEP_DEADLINE."""
    best = (float("inf"), None, None)
    default_us = None
    deadline = min(SWEEP_DEADLINE, time.monotonic() + ROW_BUDGET_S)
    for cfg in configs:
        if cfg is not None and time.monotonic() > deadline:
            print(f"  sweep budget spent: {len(configs) - configs.index(cfg)} candidates not tried", flush=True)
            break
        try:
            check = checked(fn_for(weights[0], cfg), want)
            if cfg is not None and not check["ok"]:
                continue
            t = per_call_us(lambda w, cfg=cfg: fn_for(w, cfg), weights)
        except Exception:  # too much shared memory, a tile the kernel refuses, a compile error
            if cfg is None:
                raise
            continue
        if cfg is None:
            default_us = t
        if t < best[0]:
            best = (t, cfg, check)
    return (*best, default_us)


def keep_best(kernel: str, n: int, k: int, m: int, cfg: dict | None, default: dict) -> None:
    """--sweep: the winner for the tile table (the default's own dict when it won)."""
    FOUND.setdefault(kernel, {}).setdefault((n, k), {})[m] = dict(cfg if cfg is not None else default)


def bench(family: str, shape: str, m: int, sweep: bool) -> None:
    table = SHAPES if family == "llama" else DSV3_SHAPES
    n, k = table[shape]
    label = shape if family == "llama" else f"dsv3 {shape}"
    flops = 2 * m * n * k
    x = torch.randn(m, k, device=DEV, dtype=ACT)

    try:  # bf16 (the activation dtype)
        ws = [torch.randn(n, k, device=DEV, dtype=ACT) / k**0.5 for _ in range(copies(n * k * 2))]
        us = per_call_us(lambda w: F.linear(x, w), ws)
        record(label, m, "bf16", us, n * k * 2 + m * k * 2 + m * n * 2, flops, "bf16")
        del ws
    except Exception as exc:
        record_error(label, m, "bf16", exc)

    count = copies(n * k)
    schemes = (("tensor", 0), ("channel", k), ("block", 128)) if family == "llama" else (("tensor", 0), ("block", 128))
    for scheme, group in schemes:
        try:
            bench_scheme(label, n, k, m, scheme, *ref.fp8_quant_dynamic_reference(x, group), count, sweep)
        except Exception as exc:  # e.g. out of memory making the weights
            record_error(label, m, f"{scheme} weights", exc)
        if DEV != "cpu":
            torch.cuda.empty_cache()

    # the activation quant alone (x [m, K] in, e4m3 + scales out); no weight: L2-warm by nature
    quants = (("quant token", k), ("quant group", 128)) if family == "llama" else (("quant group", 128),)
    for name, group in quants:
        try:
            q, s = fp8_quant.quant_dynamic(x, group)
            q_ref, s_ref = ref.fp8_quant_dynamic_reference(x, group)
            # flips counted where the group's scale is the reference's (as the GPU tests count them):
            # where the kernel's amax rounded the other way the whole group moves, by one step at most
            same = (s.reshape(s_ref.shape) == s_ref).repeat_interleave(group, -1)
            flipped = (q.float() - q_ref.float()).abs().gt(0)
            flips = flipped[same].float().mean().item() if same.any() else 0.0
            us = per_call_us(lambda _, group=group: fp8_quant.quant_dynamic(x, group), [None])
            record(label, m, name, us, m * k * (ACT.itemsize + 1) + s.numel() * 4, 0, "fp8",
                   flipped=flips, ok=flips < 1e-3)  # fmt: skip
        except Exception as exc:
            record_error(label, m, name, exc)


def gemm_configs(m: int, block: bool) -> list[dict]:
    """GEMM candidates: at prefill sizes the Hopper FP8 tiles (128 or 256 a side, K step 128 = the
    scale group; 8 warps where the block path holds a dot tile beside the accumulator), 3-5 stages
    and two L2 groupings; smaller M tiles for fewer rows."""

    def tile(bm, bn, nw, st, gm=8):
        return dict(block_m=bm, block_n=bn, block_k=128, num_warps=nw, num_stages=st, group_m=gm)

    if m >= 1024:
        grid = [tile(bm, bn, nw, st) for (bm, bn), nw, st in
                itertools.product(((128, 128), (128, 256), (256, 128)), (8,), (3, 4, 5))]  # fmt: skip
        grid += [tile(128, 128, 4, st) for st in (3, 4)] + [tile(64, 256, 8, 4), tile(64, 128, 4, 4)]
        grid += [tile(128, 128, 8, 4, gm) for gm in (4, 16)] + [tile(128, 256, 8, 4, 16)]
        grid += [dict(tile(bm, bn, 8, st), tma=True) for (bm, bn), st in
                 itertools.product(((128, 128), (128, 256), (256, 128)), (3, 4))]  # fmt: skip
        return grid if block else grid + [tile(128, 256, 8, 3, 8)]
    return [
        tile(bm, bn, nw, st)
        for bm, bn, nw, st in itertools.product((16, 32, 64, 128), (64, 128, 256), (4, 8), (3, 4))
        if bm <= max(16, triton.next_power_of_2(m))
    ]


def gemv_configs(block: bool) -> list[dict]:
    """GEMV candidates: the tensor-core kernel (rows a program, K step, depth, split-K) and the
    CUDA-core kernels (the first run's tiles and around them; per-tensor / per-row scales: the
    packed-f16 loop first, so a short row budget still reaches it)."""
    if block:
        dot = [dict(kernel="dot", block_n=bn, block_k=128, num_stages=st, split_k=sk, num_warps=4)
               for bn, st, sk in itertools.product((16, 32), (4, 6, 8), (1, 2))]  # fmt: skip
        dot += [dict(kernel="dot", block_n=16, block_k=128, num_stages=8, split_k=1, num_warps=nw) for nw in (2, 8)]
        reduce = [dict(kernel="reduce", block_n=bn, groups_per_step=r, num_warps=nw)
                  for bn, r, nw in itertools.product((2, 4, 8), (4, 8), (4, 8))]  # fmt: skip
        return dot + reduce
    dot = [dict(kernel="dot", block_n=bn, block_k=bk, num_stages=st, split_k=sk, num_warps=4)
           for bn, bk, st, sk in itertools.product((16, 32, 64), (256, 512, 1024), (3, 4, 6), (1, 2))
           if bn * bk <= 32768]  # fmt: skip
    dot += [dict(kernel="dot", block_n=16, block_k=512, num_stages=4, split_k=1, num_warps=nw) for nw in (2, 8)]
    reduce = [dict(kernel=kern, block_n=bn, block_k=bk, num_warps=nw)
              for kern, bn, bk, nw in itertools.product(("reduce_f16", "reduce"), (2, 4, 8), (1024, 2048, 4096), (4, 8))
              if kern == "reduce_f16" or bn < 8]  # fmt: skip
    return reduce + dot


def engine_block_route(xq, xs, w, ws) -> str:
    """What atomc's fp8_block_gemm runs for this call: pick_gemm's route, "triton" where cuBLAS's
    block GEMM declines (as the op's body does)."""
    route = backend.pick_gemm(xq, w, block=True)
    if route == "scaled_mm_block" and not backend.cublas_block_applies(xq, xs, w, ws, 128, 128, ACT):
        return "triton"
    return route


def bench_scheme(label, n, k, m, scheme, xq, xs, count, sweep) -> None:
    """_scaled_mm, the Triton GEMM and (M = 1) the GEMV for one weight scheme on cold weights."""
    flops = 2 * m * n * k
    ws = weights_fp8(n, k, count, scheme)
    w0_s0 = ws[0]
    w0, s0 = w0_s0
    block = (128, 128) if scheme == "block" else None
    if block:
        want = ref.fp8_block_gemm_reference(xq, xs, w0, s0, 128, 128, None, torch.float32)
    else:
        want = ref.fp8_gemm_reference(xq, xs, w0, s0, None, torch.float32)
    nbytes = n * k + m * k + m * n * 2 + s0.numel() * 4  # e4m3 weight and x, 16-bit out, scales
    route = {"engine_route": engine_block_route(xq, xs, w0, s0)} if block else {}

    def optional(impl, call, why_not, **extra):  # a _scaled_mm route: a row, or a skipped row where it declines
        try:
            out = call(w0, s0)
            if out is None:
                ROWS.append(dict(shape=label, m=m, impl=impl, skipped=why_not()))
            else:
                check = checked(out, want)
                us = per_call_us(lambda w: call(w[0], w[1]), ws)
                record(label, m, impl, us, nbytes, flops, "fp8", **check, **extra)
        except Exception as exc:
            record_error(label, m, impl, exc)

    def not_here():
        return "_scaled_mm does not run here"

    if not block:  # _scaled_mm: tensorwise and rowwise (at one row: what GEMV_ONE_ROW is decided against)
        impl = "scaled_mm tensor" if scheme == "tensor" else "scaled_mm row"
        optional(impl, lambda w, s: backend.scaled_mm(xq, xs, w, s, None, ACT), not_here)

    if scheme == "channel" and m > 1:  # tensorwise _scaled_mm with unit scales + the Triton epilogue
        engine = backend.pick_gemm(xq, w0, block=False, x_scale=xs, weight_scale=s0)
        optional("scaled_mm unit+epilogue", lambda w, s: backend.scaled_mm_unit(xq, xs, w, s, None, ACT), not_here,
                 engine_route=engine)  # fmt: skip

    if block and label.startswith("dsv3"):  # cuBLAS's block GEMM (torch._scaled_mm, 1x128 x 128x128)

        def why_block():
            why = compat.scaled_mm_blockwise_why(xq.device.index or 0, ACT) if xq.is_cuda else "not CUDA"
            return why or "declined: not sm_90, or the shape (K a multiple of 512, N of 16)"

        optional("scaled_mm block", lambda w, s: backend.scaled_mm_block(xq, xs, w, s, 128, 128, None, ACT),
                 why_block, **route)  # fmt: skip

    def gemm(w, cfg):
        return fp8_gemm(xq, xs, w[0], w[1], None, ACT, block=block, config=cfg)

    def gemv(w, cfg):
        return fp8_gemv(xq, xs, w[0], w[1], None, ACT, block=block, **(cfg or {}))

    if scheme != "tensor" and m > 1:  # the Triton GEMM (row scales and block scales)
        impl = f"triton {'block' if block else 'row'}"
        try:
            configs = [None, *(gemm_configs(m, block is not None) if sweep and scheme in SWEEP_SCHEMES else [])]
            t, cfg, check, t_default = timed_best(gemm, ws, want, configs)
            default = gemm_mod.pick_config(m, n, k, block is not None, xq.device)
            record(
                label, m, impl, t, nbytes, flops, "fp8", config=cfg or default, default_us=t_default, **check, **route
            )
            if sweep and scheme in SWEEP_SCHEMES:
                keep_best("block_gemm" if block else "row_gemm", n, k, m, cfg, default)
        except Exception as exc:
            record_error(label, m, impl, exc)
    if m == 1:  # the GEMV
        impl = f"gemv {scheme}"
        try:
            # per-tensor and per-channel weights run one kernel: the channel run's sweep stands for both
            swept = sweep and scheme != "tensor" and scheme in SWEEP_SCHEMES
            configs = [None, *(gemv_configs(block is not None) if swept else [])]
            t, cfg, check, t_default = timed_best(gemv, ws, want, configs)
            default = gemv_mod.pick_config(n, k, block is not None, xq.device)
            record(label, m, impl, t, nbytes, flops, "fp8", config=cfg or default, default_us=t_default, **check)
            if swept:
                keep_best("block_gemv" if block else "gemv", n, k, 1, cfg, default)
        except Exception as exc:
            record_error(label, m, impl, exc)


BLOCK_IMPLS = {"triton": "triton block", "cublas": "scaled_mm block"}  # the block GEMMs, by targets' prefix
ROUTE_IMPLS = {"triton": "triton block", "scaled_mm_block": "scaled_mm block", "gemv": "gemv block"}


def targets(rows: list[dict]) -> dict:
    """The issue's figures from the rows: the GEMV's batch-1 speed-up over bf16 (every shape run at M = 1) and
    the block GEMM's share of the FP8 peak and its time against _scaled_mm per-tensor (DeepSeek-V3
    shapes, M >= 2048): unprefixed for the route the engine takes (`route`), `triton_*` and `cublas_*`
    for each block GEMM that ran."""
    us = {(r["shape"], r["m"], r["impl"]): r for r in rows if "us" in r}
    out: dict = {"bs1_gemv": {}, "dsv3_block_gemm": {}}
    for (shape, m, impl), r in us.items():
        if m == 1 and impl.startswith("gemv ") and (shape, 1, "bf16") in us:
            out["bs1_gemv"][f"{shape} {impl}"] = dict(
                speedup_vs_bf16=round(us[(shape, 1, "bf16")]["us"] / r["us"], 3), pct_hbm=r["pct_hbm"]
            )
    for shape, m in sorted({(s, m) for s, m, i in us if s.startswith("dsv3") and i in BLOCK_IMPLS.values()}):
        if m < BLOCK_TARGET_M:
            continue
        ran = {name: us[(shape, m, impl)] for name, impl in BLOCK_IMPLS.items() if (shape, m, impl) in us}
        route = next((r["engine_route"] for r in ran.values() if "engine_route" in r), "triton")
        base = us.get((shape, m, "scaled_mm tensor"))
        entry: dict = dict(route=route)
        engine = us.get((shape, m, ROUTE_IMPLS.get(route, "")))
        if engine:
            entry.update(pct_fp8_peak=engine["pct_fp8_peak"], tflops=engine["tflops"],
                         meets_70pct=engine["pct_fp8_peak"] >= 70)  # fmt: skip
        if base:
            entry["scaled_mm_tensor_pct_fp8_peak"] = base["pct_fp8_peak"]
            if engine:
                entry["time_vs_scaled_mm"] = round(engine["us"] / base["us"], 3)
        for name, r in ran.items():
            entry[f"{name}_pct_fp8_peak"] = r["pct_fp8_peak"]
            if base:
                entry[f"{name}_time_vs_scaled_mm"] = round(r["us"] / base["us"], 3)
        out["dsv3_block_gemm"][f"{shape} M={m}"] = entry
    return out


def plan(args) -> list[tuple[str, str, int]]:
    """(family, shape, M) in the order that matters most if the run is cut short: the Llama shapes
    at one row (batch-1 decode), then DeepSeek-V3 at prefill sizes (the block target), then the
    Llama shapes at the other M."""
    llama = [s for s in args.shapes.split(",") if s]
    dsv3 = [s for s in args.dsv3_shapes.split(",") if s]
    tokens = [int(t) for t in args.tokens.split(",") if t]
    dsv3_tokens = [int(t) for t in args.dsv3_tokens.split(",") if t]
    for s in llama:
        if s not in SHAPES:
            raise SystemExit(f"unknown shape {s!r} (known: {', '.join(SHAPES)})")
    for s in dsv3:
        if s not in DSV3_SHAPES:
            raise SystemExit(f"unknown DeepSeek-V3 shape {s!r} (known: {', '.join(DSV3_SHAPES)})")
    first = [("llama", s, 1) for s in llama if 1 in tokens]
    second = [("dsv3", s, m) for m in dsv3_tokens for s in dsv3]
    rest = [("llama", s, m) for m in tokens if m != 1 for s in llama]
    return first + second + rest


def main() -> None:
    global DEV, ACT, REP_MS, BLOCK_TARGET_M, SWEEP_DEADLINE, ROW_BUDGET_S, SWEEP_SCHEMES
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("results/fp8_linear.json"))
    ap.add_argument(
        "--shapes",
        default=None,
        help=f"(N, K) shapes ({', '.join(SHAPES)}; default Llama-3.1-8B's {LLAMA_DEFAULT}; '' for none)",
    )
    ap.add_argument("--tokens", default=None, help="M for those shapes (default " + ",".join(map(str, TOKENS)))
    ap.add_argument("--dsv3-shapes", default=None, help=f"DeepSeek-V3 shapes ({', '.join(DSV3_SHAPES)}; '' for none)")
    ap.add_argument("--dsv3-tokens", default=None, help="M for them (default " + ",".join(map(str, DSV3_TOKENS)))
    ap.add_argument("--rep-ms", type=float, default=REP_MS, help="do_bench_cudagraph's rep (ms) per timing")
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="also time candidate GEMV / GEMM tiles, keep the best, write them into the tile table",
    )
    ap.add_argument(
        "--configs-out",
        type=Path,
        default=None,
        help="--sweep: the tile table's folder (default atomc/kernels/triton/configs/fp8/)",
    )
    ap.add_argument("--sweep-budget-s", type=float, default=float("inf"),
                    help="--sweep: try no new candidate after this many seconds")  # fmt: skip
    ap.add_argument(
        "--sweep-row-budget-s",
        type=float,
        default=float("inf"),
        help="--sweep: try no new candidate for one (shape, M, kernel) row after this many seconds",
    )
    ap.add_argument(
        "--sweep-schemes",
        default=",".join(SWEEP_SCHEMES),
        help="--sweep: the weight schemes swept (channel, block); the others time their default",
    )
    ap.add_argument("--tiny", action="store_true", help="toy shapes on the CPU under TRITON_INTERPRET=1")
    args = ap.parse_args()
    REP_MS = args.rep_ms
    ROW_BUDGET_S = args.sweep_row_budget_s
    SWEEP_SCHEMES = tuple(s for s in args.sweep_schemes.split(",") if s)
    if args.tiny:
        DEV, ACT, BLOCK_TARGET_M = "cpu", torch.float32, 1
        SHAPES.clear(), SHAPES.update(TINY_SHAPES)
        DSV3_SHAPES.clear(), DSV3_SHAPES.update(TINY_DSV3_SHAPES)
        defaults = (",".join(SHAPES), ",".join(map(str, TINY_TOKENS)), ",".join(DSV3_SHAPES), TINY_DSV3_TOKENS)
    else:
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
            raise SystemExit("fp8_linear.py needs a CUDA GPU with e4m3 support (sm_89+), or --tiny")
        defaults = (LLAMA_DEFAULT, ",".join(map(str, TOKENS)), DSV3_DEFAULT, DSV3_TOKENS)
    args.shapes = defaults[0] if args.shapes is None else args.shapes
    args.tokens = defaults[1] if args.tokens is None else args.tokens
    args.dsv3_shapes = defaults[2] if args.dsv3_shapes is None else args.dsv3_shapes
    args.dsv3_tokens = ",".join(map(str, defaults[3])) if args.dsv3_tokens is None else args.dsv3_tokens
    steps = plan(args)
    SWEEP_DEADLINE = time.monotonic() + args.sweep_budget_s
    if args.tiny and args.configs_out is None:  # toy shapes on the CPU: never into the package's table
        args.configs_out = args.out.parent / "fp8_configs"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
        gpu=torch.cuda.get_device_name() if DEV == "cuda" else "cpu (TRITON_INTERPRET=1)", torch=torch.__version__,
        triton=triton.__version__, host=platform.machine(), activation_dtype=str(ACT), rep_ms=REP_MS,
        rule=dict(gemv_one_row=backend.GEMV_ONE_ROW, triton_gemm_max_rows=backend.TRITON_GEMM_MAX_ROWS,
                  unit_scale_max_rows=backend.UNIT_SCALE_MAX_ROWS,
                  cublas_block_min_rows=backend.CUBLAS_BLOCK_MIN_ROWS),
    )  # fmt: skip
    for family, shape, m in steps:
        bench(family, shape, m, args.sweep)
        # after every (shape, M): a crash or a timeout later keeps what finished
        args.out.write_text(json.dumps({"meta": meta, "targets": targets(ROWS), "rows": ROWS}, indent=1))
        if args.sweep and FOUND:
            dev = tuned_files.tile_device(torch.device(DEV))
            path = fp8_config.merge_into_file(
                FOUND, dev.name, {**meta, "device": dev.name, "family": dev.family}, args.configs_out
            )
            print(f"  tile table: {path}", flush=True)
    print(json.dumps(targets(ROWS), indent=1))
    errors = [r for r in ROWS if "error" in r or r.get("ok") is False]
    print(f"wrote {args.out}: {len(ROWS)} rows, {len(errors)} failed")
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
