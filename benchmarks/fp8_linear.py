"""FP8 linears at Llama-3.1-8B shapes: bf16 F.linear against torch._scaled_mm and atomc's Triton FP8
GEMM / GEMV (atomc/kernels/triton/fp8_*.py), M = 1, 8, 64, 512, 4096, on an H200.

    python benchmarks/fp8_linear.py --out results/fp8_linear.json [--sweep]
        [--shapes qkv,o,gate_up,down] [--tokens 1,8,64,512,4096]

Rows per (shape, M), each implementation checked against the dequantising reference first:
- `bf16`: F.linear on bf16 weights (cuBLAS), what atomc runs unquantised;
- `scaled_mm tensor` / `scaled_mm row`: torch._scaled_mm, per-tensor scales / per-token x
  per-channel (rowwise), what atomc's fp8_gemm runs above one row today;
- `triton row` / `triton block`: the Triton FP8 GEMM, per-token x per-channel / 1x128 x 128x128;
- `gemv tensor|channel|block` (M = 1 only): the Triton FP8 GEMV, what atomc runs at batch 1;
- `quant token` / `quant group`: the activation quant kernel alone at this M (what a linear whose
  quant was not fused into a norm or SiLU pays on top of its GEMM).
The GEMM rows take an already quantised activation, as atomc's fp8_gemm does.

Timing: CUDA-graph replays of back-to-back calls over enough copies of the weight (>= 320 MiB in
all) that none is in L2, as in a model, which streams every other layer between two uses of one
weight; the median µs of one call. `pct_hbm` = bytes (weight + x + out, each read or written once)
/ µs against 4.3 TB/s (the H200's measured copy rate, as kernels_bench.py); `pct_roofline` takes
the larger of that and the FLOPs against the dense peak (989 TFLOP/s bf16, 1,979 fp8), so it is the
share of what the shape allows. `--sweep` also times a grid of GEMV and GEMM tiles and keeps the
best (the defaults in fp8_gemv.gemv_config / fp8_gemm.gemm_config are untuned starting points).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench_cudagraph

from atomc.kernels.triton import fp8 as backend
from atomc.kernels.triton import fp8_quant
from atomc.kernels.triton.fp8_gemm import fp8_gemm
from atomc.kernels.triton.fp8_gemv import fp8_gemv
from atomc.ops import fp8 as ref

PEAK_GBPS = 4300.0
PEAK_TFLOPS = {"bf16": 989.0, "fp8": 1979.0}
COLD_BYTES = 320 * 2**20
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
DEV = "cuda"
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TOKENS = (1, 8, 64, 512, 4096)
ROWS: list[dict] = []


def rel_err(out, want) -> float:
    return ((out.float() - want.float()).norm() / want.float().norm()).item()


def per_call_us(fn, weights: list) -> float:
    """Median µs of one call from a graph of calls over every weight copy in turn."""
    fn(weights[0])
    torch.cuda.synchronize()
    return do_bench_cudagraph(lambda: [fn(w) for w in weights], rep=50, return_mode="median") * 1e3 / len(weights)


def record(shape, m, impl, us, nbytes, flops, kind, **extra) -> None:
    t_bw = nbytes / (PEAK_GBPS * 1e9) * 1e6
    t_flop = flops / (PEAK_TFLOPS[kind] * 1e12) * 1e6
    row = dict(
        shape=shape, m=m, impl=impl, us=round(us, 2), pct_hbm=round(100 * t_bw / us, 1),
        pct_roofline=round(100 * max(t_bw, t_flop) / us, 1), tflops=round(flops / us / 1e6, 1), **extra,
    )  # fmt: skip
    ROWS.append(row)
    print(
        f"{shape:8s} M={m:5d} {impl:18s} {us:9.2f} us  {row['pct_hbm']:6.1f}% HBM  {row['pct_roofline']:6.1f}% roofline"
    )


def copies(nbytes: int) -> int:
    return max(2, -(-COLD_BYTES // nbytes))


def weights_fp8(n, k, count, scheme):
    out = []
    for i in range(count):
        g = torch.Generator(DEV).manual_seed(i)
        w = (torch.randn(n, k, device=DEV, generator=g) * 64).clamp(-448, 448).to(FP8)
        if scheme == "tensor":
            s = torch.rand(1, device=DEV) / 50
        elif scheme == "channel":
            s = torch.rand(n, device=DEV) / 50
        else:
            s = torch.rand(-(-n // 128), k // 128, device=DEV) / 50
        out.append((w, s))
    return out


def timed_best(fn_for, weights, check, configs):
    """(µs, config) of the fastest config that passes `check` (configs: [None] for the default)."""
    best = (float("inf"), None)
    for cfg in configs:
        try:
            check(cfg)
            t = per_call_us(lambda w, cfg=cfg: fn_for(w, cfg), weights)
        except triton.runtime.errors.OutOfResources:
            continue
        if t < best[0]:
            best = (t, cfg)
    return best


def bench(shape: str, m: int, sweep: bool) -> None:
    n, k = SHAPES[shape]
    flops = 2 * m * n * k
    x = torch.randn(m, k, device=DEV, dtype=BF16)

    # bf16
    ws = [torch.randn(n, k, device=DEV, dtype=BF16) / k**0.5 for _ in range(copies(n * k * 2))]
    record(
        shape, m, "bf16", per_call_us(lambda w: F.linear(x, w), ws), n * k * 2 + m * k * 2 + m * n * 2, flops, "bf16"
    )
    del ws

    count = copies(n * k)
    for scheme, group in (("tensor", 0), ("channel", k), ("block", 128)):
        bench_scheme(shape, m, scheme, *ref.fp8_quant_dynamic_reference(x, group), count, sweep)

    # the activation quant alone (x [m, K] bf16 in, e4m3 + scales out); no weight: L2-warm by nature
    for name, group in (("quant token", k), ("quant group", 128)):
        q, s = fp8_quant.quant_dynamic(x, group)
        q_ref, _ = ref.fp8_quant_dynamic_reference(x, group)
        assert (q.float() - q_ref.float()).abs().gt(0).float().mean() < 1e-3
        fn = lambda group=group: fp8_quant.quant_dynamic(x, group)  # noqa: E731
        us = do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
        record(shape, m, name, us, m * k * 3 + s.numel() * 4, 0, "fp8")


def gemm_configs(m: int) -> list[dict]:
    return [
        dict(block_m=bm, block_n=bn, block_k=128, num_warps=nw, num_stages=st)
        for bm, bn, nw, st in itertools.product((16, 32, 64, 128), (64, 128, 256), (4, 8), (3, 4))
        if bm <= max(16, triton.next_power_of_2(m))
    ]


def gemv_configs(block: bool) -> list[dict]:
    if block:
        grid = itertools.product((1, 2, 4, 8, 16), (1, 2, 4, 8), (4, 8))
        return [dict(block_n=bn, groups_per_step=r, num_warps=nw) for bn, r, nw in grid]
    grid = itertools.product((1, 2, 4, 8), (1024, 2048, 4096), (4, 8))
    return [dict(block_n=bn, block_k=bk, num_warps=nw) for bn, bk, nw in grid]


def bench_scheme(shape, m, scheme, xq, xs, count, sweep) -> None:
    """_scaled_mm, the Triton GEMM and (M = 1) the GEMV for one weight scheme on cold weights."""
    n, k = SHAPES[shape]
    flops = 2 * m * n * k
    ws = weights_fp8(n, k, count, scheme)
    w0_s0 = ws[0]
    w0, s0 = w0_s0
    block = (128, 128) if scheme == "block" else None
    if block:
        want = ref.fp8_block_gemm_reference(xq, xs, w0, s0, 128, 128, None, torch.float32)
    else:
        want = ref.fp8_gemm_reference(xq, xs, w0, s0, None, torch.float32)
    nbytes = n * k + m * k + m * n * 2 + s0.numel() * 4  # e4m3 weight and x, bf16 out, scales

    if not block:  # _scaled_mm: tensorwise and rowwise
        out = backend.scaled_mm(xq, xs, w0, s0, None, BF16)
        assert out is not None and rel_err(out, want) < 1e-2
        us = per_call_us(lambda w: backend.scaled_mm(xq, xs, w[0], w[1], None, BF16), ws)
        record(shape, m, "scaled_mm tensor" if scheme == "tensor" else "scaled_mm row", us, nbytes, flops, "fp8")

    def gemm(w, cfg):
        return fp8_gemm(xq, xs, w[0], w[1], None, BF16, block=block, config=cfg)

    def gemv(w, cfg):
        return fp8_gemv(xq, xs, w[0], w[1], None, BF16, block=block, **(cfg or {}))

    if scheme != "tensor":  # the Triton GEMM (row scales and block scales)
        configs = [None, *(gemm_configs(m) if sweep else [])]
        t, cfg = timed_best(gemm, ws, lambda cfg: _check(gemm(w0_s0, cfg), want), configs)
        record(shape, m, f"triton {'block' if block else 'row'}", t, nbytes, flops, "fp8", config=cfg)
    if m == 1:  # the GEMV
        configs = [None, *(gemv_configs(block is not None) if sweep else [])]
        t, cfg = timed_best(gemv, ws, lambda cfg: _check(gemv(w0_s0, cfg), want), configs)
        record(shape, m, f"gemv {scheme}", t, nbytes, flops, "fp8", config=cfg)
    del ws
    torch.cuda.empty_cache()


def _check(out, want):
    assert rel_err(out, want) < 1e-2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("results/fp8_linear.json"))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--sweep", action="store_true", help="also time a grid of GEMV / GEMM tiles, keep the best")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("fp8_linear.py needs a CUDA GPU with e4m3 support (sm_89+)")
    for shape in args.shapes.split(","):
        for m in map(int, args.tokens.split(",")):
            bench(shape, m, args.sweep)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        host=platform.machine(),
        rule=dict(gemv_one_row=backend.GEMV_ONE_ROW, triton_gemm_max_rows=backend.TRITON_GEMM_MAX_ROWS),
    )  # fmt: skip
    args.out.write_text(json.dumps({"meta": meta, "rows": ROWS}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
