"""One-row FP8 GEMV for decode at batch 1: y[N] = (xq * x_scale) . (W_e4m3 * w_scale)^T (+ bias).

At one row a linear is its weight reads, and e4m3 weights are half the bytes of bf16: this kernel
is where FP8 pays at batch 1. Three kernels, picked per (N, K) by the tile table (fp8_config.py;
without an entry `gemv_config`: "reduce_f16" for per-tensor / per-row scales, "dot" for blocks):

- "dot": tensor cores. The row padded to 16 (masked: no extra traffic) times a
  [BLOCK_N >= 16, BLOCK_K] e4m3 weight tile per step into fp32. Why not the bf16 GEMV's CUDA-core
  loop: at one e4m3 byte a weight value, that loop pays an e4m3 -> fp32 conversion (two
  instructions on Hopper: e4m3x2 -> f16x2 -> f32) and a multiply-add per byte, 2.6x the
  instructions per byte of bf16, and its fp32 register tile for the same bytes in flight is twice
  bf16's, so fewer programs fit an SM; the first H200 run had it at 39-71% of HBM. A dot does the
  conversion in the tensor core, and its loads are the ones Triton pipelines through shared memory
  (num_stages deep), so the bytes in flight cost no registers; the same 16-row dot in the FP8 GEMM
  at M = 8 read gate_up at 89% of HBM. `split_k` cuts K over programs (fp32 atomics) for shapes
  with few row tiles.
- "reduce": the bf16 reduce GEMV's loop (`gemv.row_dot`, shared: per-tensor / per-row scales go
  after the sum, so the loop is the bf16 one on e4m3 loads). Despite the instruction count above,
  the sweeps on the H200 and the H100 picked it over the dot at N <= 6,144: there 2-4 rows a
  program give 1,000-3,000 programs, where the 16-row dot gives a few hundred.
- "reduce_f16": that loop with the products and the per-column partial sums in packed f16
  (`gemv.row_dot` in float16): one e4m3x2 -> f16x2 convert and one f16x2 FMA a weight pair, 2.25 loop
  instructions a weight byte on sm_90 against the fp32 loop's 4.0 (`benchmarks/gemv_sass.py`),
  exact products, f16 rounding only on the few partial sums a column adds (about 3e-4 of the
  output's norm, below its bf16 rounding). The default for per-tensor / per-row scales.

Scales, as atomc::fp8_gemm / fp8_block_gemm give them:
- per tensor ([1]) or per output row ([N]: per-channel weights, or a merged layer's per-section
  scales laid out by row) times x's one scale: applied once, after the sum;
- block (`w_scale` [ceil(N/bn), K/bk], `x_scale` [K/bk] per token group): a program's rows lie in
  one weight block, so a group's scale is x_scale[g] * w_scale[n // bn, g], one value for the
  program: the dot kernel multiplies each step's dot by it (a step inside one group, the scale
  loaded a step ahead); the reduce kernel folds it into the row before the multiply-add, so a
  weight value costs what it does per tensor (the first run's block GEMV multiplied every product
  by a gathered [BLOCK_N, R] scale tile: 0.82-1.15x bf16).
The activation is read as the op gives it: already e4m3 (the quant op before, or the fused norm /
SiLU quant, wrote it), K bytes next to N*K of weight.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from atomc.kernels.triton import fp8_config, pdl, tuned_files
from atomc.kernels.triton.gemv import row_dot
from atomc.kernels.triton.packed_f16 import e4m3_x_shift
from atomc.kernels.triton.pdl import after_producer


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr,
    N, K, stride_wn, stride_wsn,
    WS_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr, F16_SUMS: tl.constexpr = False, X_SHIFT: tl.constexpr = 1.0,
):  # fmt: skip
    """Per-tensor or per-row scales (WS_ROWS: w_scale has one value per output row). PDL: pdl.py
    (the row loop waits before it reads x; the activation scale is read after it). F16_SUMS: the
    packed-f16 loop (row_dot in float16, below), its x scaled by X_SHIFT, undone here."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if F16_SUMS:
        y = row_dot(x_ptr, w_ptr, offs_n, n_ok, K, stride_wn, BLOCK_N, BLOCK_K, PDL, tl.float16, X_SHIFT)
        y = y * (tl.load(xs_ptr) / X_SHIFT)
    else:
        y = row_dot(x_ptr, w_ptr, offs_n, n_ok, K, stride_wn, BLOCK_N, BLOCK_K, PDL) * tl.load(xs_ptr)
    if WS_ROWS:
        y = y * tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)
    else:
        y = y * tl.load(ws_ptr)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _fp8_block_gemv_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr,
    N, K, stride_wn, stride_wsn, SCALE_ROWS,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, R: tl.constexpr, GROUP_K: tl.constexpr,
):  # fmt: skip
    """Block scales on the CUDA cores: SCALE_ROWS = the weight block's rows (bn, a multiple of
    BLOCK_N, so a program's rows share one scale a group), GROUP_K its columns (bk). The group's
    two scales are folded into the row x once per step ([R, GROUP_K], shared by the BLOCK_N rows),
    so each weight value costs one multiply-add, as in the per-tensor loop."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_n % N  # in bounds: no load mask; the store drops rows past N
    offs_r = tl.arange(0, R)
    offs_j = tl.arange(0, GROUP_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None, None] * stride_wn
    ws_row = ws_ptr + ((tl.program_id(0) * BLOCK_N) // SCALE_ROWS) * stride_wsn
    acc = tl.zeros((BLOCK_N, R, GROUP_K), dtype=tl.float32)
    n_groups = K // GROUP_K
    for g0 in range(0, n_groups, R):
        g = g0 + offs_r  # the R groups of this step
        g_ok = g < n_groups
        offs_k = g[:, None] * GROUP_K + offs_j[None, :]  # [R, GROUP_K]
        s = tl.load(xs_ptr + g, mask=g_ok, other=0.0) * tl.load(ws_row + g, mask=g_ok, other=0.0)
        x = tl.load(x_ptr + offs_k, mask=g_ok[:, None], other=0.0).to(tl.float32) * s[:, None]
        w = tl.load(w_rows + offs_k[None, :, :], mask=g_ok[None, :, None], other=0.0)
        acc += w.to(tl.float32) * x[None, :, :]
    y = tl.sum(tl.sum(acc, 2), 1)
    n_ok = offs_n < N
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _fp8_gemv_dot_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr,
    N, K, k_per_split, stride_wn, stride_wsn, SCALE_ROWS,
    WS_ROWS: tl.constexpr, BLOCK_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr,
    EVEN_K: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Tensor cores: the row padded to 16 (rows 1-15 masked to zeros: no memory traffic) times a
    [BLOCK_N, BLOCK_K] weight tile per step, fp32 accumulation; split K over program_id(1) adds
    fp32 partial sums with atomics (ATOMIC). Block scales: a step lies inside one group (BLOCK_K
    divides GROUP_K) and BLOCK_N inside one weight block, so a step's dot is scaled by one scalar
    x_scale[g] * w_scale[n // bn, g], loaded a step ahead. PDL: the first step is peeled, its weight
    tile loaded before `after_producer` (pdl.py), as the reduce GEMV's row_dot does."""
    pid_n = tl.program_id(0)
    k_lo = tl.program_id(1) * k_per_split
    offs_m = tl.arange(0, 16)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = offs_n % N  # in bounds: no load mask; the store drops rows past N
    x_row = (offs_m == 0)[:, None]
    x_ptrs = x_ptr + k_lo + offs_m[:, None] * 0 + offs_k[None, :]
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + k_lo + offs_k[None, :]
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w = _dot_gemv_w_tile(w_ptrs, k_lo, k_hi, offs_k, EVEN_K)
    after_producer(PDL)
    x = _dot_gemv_x_tile(x_ptrs, k_lo, k_hi, offs_k, x_row, EVEN_K)
    last_group = K // GROUP_K - 1
    ws_row = ws_ptr + ((pid_n * BLOCK_N) // SCALE_ROWS) * stride_wsn
    s = 1.0
    if BLOCK_SCALES:
        s = tl.load(xs_ptr + k_lo // GROUP_K) * tl.load(ws_row + k_lo // GROUP_K)
    acc, s = _dot_gemv_step(tl.zeros((16, BLOCK_N), dtype=tl.float32), x, w, s, xs_ptr, ws_row, k_lo, last_group,
                            BLOCK_SCALES, GROUP_K, BLOCK_K)  # fmt: skip
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        w = _dot_gemv_w_tile(w_ptrs, k0, k_hi, offs_k, EVEN_K)
        x = _dot_gemv_x_tile(x_ptrs, k0, k_hi, offs_k, x_row, EVEN_K)
        acc, s = _dot_gemv_step(acc, x, w, s, xs_ptr, ws_row, k0, last_group, BLOCK_SCALES, GROUP_K, BLOCK_K)
    if not BLOCK_SCALES:
        acc = acc * tl.load(xs_ptr)
        if WS_ROWS:
            acc = acc * tl.load(ws_ptr + rows)[None, :]
        else:
            acc = acc * tl.load(ws_ptr)
    if HAS_BIAS:
        first = (tl.program_id(1) == 0).to(tl.float32)  # the first K split adds it
        acc += tl.load(b_ptr + rows).to(tl.float32)[None, :] * first
    y_ptrs = y_ptr + offs_m[:, None] * 0 + offs_n[None, :]
    ok = x_row & (offs_n < N)[None, :]
    if ATOMIC:
        tl.atomic_add(y_ptrs, acc, mask=ok)
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dot_gemv_w_tile(w_ptrs, k0, k_hi, offs_k, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(w_ptrs)
    return tl.load(w_ptrs, mask=((k0 + offs_k) < k_hi)[None, :], other=0.0)


@triton.jit
def _dot_gemv_x_tile(x_ptrs, k0, k_hi, offs_k, x_row, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(x_ptrs, mask=x_row, other=0.0)
    return tl.load(x_ptrs, mask=x_row & ((k0 + offs_k) < k_hi)[None, :], other=0.0)


@triton.jit
def _dot_gemv_step(
    acc, x, w, s, xs_ptr, ws_row, k0, last_group,
    BLOCK_SCALES: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One K step of the dot GEMV: (acc, the next step's block scale)."""
    if BLOCK_SCALES:
        g_next = tl.minimum((k0 + BLOCK_K) // GROUP_K, last_group)
        s_next = tl.load(xs_ptr + g_next) * tl.load(ws_row + g_next)
        acc += tl.dot(x, tl.trans(w)) * s
        return acc, s_next
    # promote the fp8 products to fp32 once a step: Triton's sm_90 default never does
    return tl.dot(x, tl.trans(w), acc, max_num_imprecise_acc=BLOCK_K), s


def dot_config(block: bool) -> dict:
    """The tensor-core kernel's default tiles: 16 weight rows a program (the fewest a dot takes),
    K steps of 512 values four deep (32 KiB of weight in flight a program, staged in shared memory
    by Triton's pipeliner, not held in registers); block scales step one 128-group at a time, eight
    deep."""
    if block:
        return dict(kernel="dot", block_n=16, block_k=128, split_k=1, num_warps=4, num_stages=8)
    return dict(kernel="dot", block_n=16, block_k=512, split_k=1, num_warps=4, num_stages=4)


REDUCE_DEFAULTS = dict(block_n=2, block_k=2048, groups_per_step=8, num_warps=4)
CUDA_CORE_KERNELS = ("reduce", "reduce_f16")  # row loops on the CUDA cores (fp32 / packed-f16 sums)


def gemv_config(n: int, k: int, block: bool) -> dict:
    """Default tiles for a shape with no tuned entry. Per-tensor / per-row scales: the packed-f16
    CUDA-core loop at every N. The H100 sweep at `ce1bc5f` (docs/performance.md section 16) picked
    it at all four of Llama-3.1-8B's shapes, over the fp32 loop and the dot kernel: o 6.5 us
    (4 rows x 2,048; the fp32 loop's best 7.0), qkv 9.6 (2 x 2,048; 10.0), down 20.9 (4 x 4,096;
    20.8 for the fp32 loop, a tie), gate_up 38.8 (2 x 2,048; the 32-row dot 40.3). Block scales keep
    the dot kernel (no sweep has compared the two)."""
    if block:
        return dot_config(True)
    small = n <= 4096  # 4 rows x 2,048 (o's winner) else 2 x 2,048 (qkv's and gate_up's)
    return dict(kernel="reduce_f16", block_n=4 if small else 2, block_k=2048, num_warps=4)


def pick_config(n: int, k: int, block: bool, device: torch.device) -> dict:
    """The tuned entry for (N, K) on this device over its kernel's defaults; gemv_config without one."""
    dev = tuned_files.tile_device(device)
    found = fp8_config.tuned("block_gemv" if block else "gemv", n, k, 1, dev.name, family=dev.family)
    default = gemv_config(n, k, block)
    if not found:
        return default
    kernel = found.get("kernel", default["kernel"])
    base = default if kernel == default["kernel"] else dot_config(block) if kernel == "dot" else {}
    return {**base, **found, "kernel": kernel}


def fp8_gemv(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    block: tuple[int, int] | None = None,
    kernel: str | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    groups_per_step: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """atomc::fp8_gemm (block None) or atomc::fp8_block_gemm (block = (bn, bk)) for one row
    xq [..., K] (one row in all). The keywords are tuning knobs over the picked config: kernel
    "dot" (tensor cores; block_n >= 16, split_k), "reduce" (CUDA cores; block scales step
    groups_per_step groups) or "reduce_f16" (CUDA cores, packed-f16 products and partial sums;
    per-tensor / per-row scales)."""
    n, k = weight.shape
    if xq.numel() != k or weight.stride(-1) != 1:
        raise ValueError(f"fp8_gemv takes one row and a row-major weight; got x {tuple(xq.shape)}")
    given = dict(kernel=kernel, block_n=block_n, block_k=block_k, split_k=split_k,
                 groups_per_step=groups_per_step, num_warps=num_warps, num_stages=num_stages)  # fmt: skip
    picked = pick_config(n, k, block is not None, xq.device)
    chosen = kernel or picked["kernel"]
    if block is not None and block[0] % 16 and chosen == "dot":  # 16-row programs would span weight blocks
        chosen = "reduce"
    if block is not None and chosen == "reduce_f16":
        raise ValueError("fp8_gemv: the packed-f16 loop takes per-tensor or per-row scales, not blocks")
    if picked["kernel"] != chosen:  # another kernel than the picked one: its own defaults
        picked = dot_config(block is not None) if chosen == "dot" else {}
    base = {**REDUCE_DEFAULTS, **picked} if chosen in CUDA_CORE_KERNELS else picked
    cfg = {**base, **{key: v for key, v in given.items() if v is not None}, "kernel": chosen}
    x = xq.reshape(k)
    x = x if x.stride(0) == 1 else x.contiguous()
    xs = x_scale.float().reshape(-1)
    ws = weight_scale.float()
    b = bias if bias is not None else weight
    if block is not None:
        bn, bk = block
        if k % bk or bk & (bk - 1):
            raise ValueError(f"fp8_gemv: block columns {bk} must be a power of two dividing K = {k}")
    if chosen in CUDA_CORE_KERNELS:
        return _reduce(x, xs, weight, ws, b, bias is not None, out_dtype, block, cfg).view(*xq.shape[:-1], n)
    if chosen != "dot":
        raise ValueError(f"fp8_gemv: unknown kernel {cfg['kernel']!r} (dot, reduce, reduce_f16)")
    bn_tile = cfg["block_n"]
    if bn_tile < 16 or bn_tile & (bn_tile - 1):
        raise ValueError(f"fp8_gemv: the dot kernel takes a power-of-two block_n >= 16, got {bn_tile}")
    step = min(cfg["block_k"], max(32, triton.next_power_of_2(k)))  # an e4m3 MMA takes K in 32s
    if block is not None:
        step = min(step, bk)
        bn_tile = math.gcd(bn_tile, bn)  # a program's rows share one weight block (bn a multiple of 16)
    splits = max(1, min(cfg.get("split_k", 1), triton.cdiv(k, step)))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), step) * step
    splits = triton.cdiv(k, k_per_split)
    atomic = splits > 1
    # split K adds fp32 partial sums into a zeroed buffer; one split writes the output directly
    y = torch.zeros(n, dtype=torch.float32, device=xq.device) if atomic else xq.new_empty(n, dtype=out_dtype)
    _fp8_gemv_dot_kernel[(triton.cdiv(n, bn_tile), splits)](
        x, xs, weight, ws, b, y, n, k, k_per_split, weight.stride(0), ws.stride(0) if ws.dim() == 2 else 0,
        block[0] if block is not None else 1,
        WS_ROWS=ws.numel() > 1, BLOCK_SCALES=block is not None, HAS_BIAS=bias is not None, ATOMIC=atomic,
        EVEN_K=k % step == 0, GROUP_K=block[1] if block is not None else step, BLOCK_N=bn_tile, BLOCK_K=step,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl.launch(xq),
    )  # fmt: skip
    y = y.to(out_dtype) if atomic else y
    return y.view(*xq.shape[:-1], n)


def w8a16_gemv(
    x: torch.Tensor, unit_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias, out_dtype
) -> torch.Tensor:
    """y = x . (weight * weight_scale)^T (+ bias) for one row x [..., K] in its own dtype (bf16,
    fp16, fp32: no activation quant), per-tensor or per-row weight scales: the fp32 CUDA-core loop
    ("reduce": row_dot widens x and the e4m3 weights to fp32; the packed-f16 loop needs x in f16's
    range, which only an e4m3 x guarantees), on the tuned tile of (N, K) when that is a CUDA-core
    one. `unit_scale`: an fp32 one on x's device (the kernel multiplies by an x scale)."""
    n, k = weight.shape
    picked = pick_config(n, k, False, x.device)
    tile = {key: picked[key] for key in ("block_n", "block_k", "num_warps") if key in picked}
    if picked["kernel"] not in CUDA_CORE_KERNELS:
        tile = {}  # a dot tile: the loop's own defaults
    return fp8_gemv(x, unit_scale, weight, weight_scale, bias, out_dtype, kernel="reduce", **tile)


def _reduce(x, xs, weight, ws, b, has_bias, out_dtype, block, cfg) -> torch.Tensor:
    """The CUDA-core kernels (row_dot for per-tensor / per-row scales, the block loop for blocks)."""
    n, k = weight.shape
    y = torch.empty(n, dtype=out_dtype, device=x.device)
    block_n, num_warps, num_stages = cfg["block_n"], cfg["num_warps"], cfg.get("num_stages", 4)
    if block is None:
        block_k = min(cfg["block_k"], triton.next_power_of_2(k))
        f16 = cfg["kernel"] == "reduce_f16"
        _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
            x, xs, weight, ws.reshape(-1), b, y, n, k, weight.stride(0), 0,
            WS_ROWS=ws.numel() > 1, HAS_BIAS=has_bias, BLOCK_N=block_n, BLOCK_K=block_k,
            F16_SUMS=f16, X_SHIFT=e4m3_x_shift(k, block_k) if f16 else 1.0,
            num_warps=num_warps, num_stages=num_stages, **pdl.launch(x),
        )  # fmt: skip
        return y
    bn, bk = block
    block_n = math.gcd(block_n, bn)  # a program's rows share one weight block
    r = min(cfg["groups_per_step"], triton.next_power_of_2(k // bk))
    _fp8_block_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, xs, weight, ws, b, y, n, k, weight.stride(0), ws.stride(0), bn,
        HAS_BIAS=has_bias, BLOCK_N=block_n, R=r, GROUP_K=bk, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return y
