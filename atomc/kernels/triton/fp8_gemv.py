"""One-row FP8 GEMV for decode at batch 1: y[N] = (xq * x_scale) . (W_e4m3 * w_scale)^T (+ bias).

At one row a linear is its weight reads, and e4m3 weights are half the bytes of bf16: this kernel
is where FP8 pays at batch 1. It is the bf16 reduce GEMV (gemv.py) with e4m3 weights: each program
streams a [BLOCK_N, BLOCK_K] weight tile along K (contiguous, coalesced), multiplies it by the row
on the CUDA cores into an fp32 register tile and sums once at the end; BLOCK_N is small so even
N = 4,096 spreads over many programs.

Scales, as atomc::fp8_gemm / fp8_block_gemm give them:
- per tensor ([1]) or per output row ([N]: per-channel weights, or a merged layer's per-section
  scales laid out by row) times x's one scale: applied once, after the sum;
- block (`w_scale` [ceil(N/bn), K/bk], `x_scale` [K/bk] per token group): the tile is
  [BLOCK_N, R, bk] (R groups of K a step) and each group's products are scaled by
  w_scale[n // bn, g] * x_scale[g] before they are added, as the reference dequantises.
The activation is read as the op gives it: already e4m3 (the quant op before, or the fused norm /
SiLU quant, wrote it), K bytes next to N*K of weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomc.kernels.triton.gemv import row_dot


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr,
    N, K, stride_wn, stride_wsn,
    WS_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Per-tensor or per-row scales (WS_ROWS: w_scale has one value per output row)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    y = row_dot(x_ptr, w_ptr, offs_n, n_ok, K, stride_wn, BLOCK_N, BLOCK_K) * tl.load(xs_ptr)
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
    """Block scales: SCALE_ROWS = the weight block's rows (bn), GROUP_K its columns (bk)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_r = tl.arange(0, R)
    offs_j = tl.arange(0, GROUP_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None, None] * stride_wn
    ws_rows = ws_ptr + (offs_n // SCALE_ROWS)[:, None] * stride_wsn
    acc = tl.zeros((BLOCK_N, R, GROUP_K), dtype=tl.float32)
    n_groups = K // GROUP_K
    for g0 in range(0, n_groups, R):
        g = g0 + offs_r  # the R groups of this step
        g_ok = g < n_groups
        offs_k = g[:, None] * GROUP_K + offs_j[None, :]  # [R, GROUP_K]
        x = tl.load(x_ptr + offs_k, mask=g_ok[:, None], other=0.0).to(tl.float32)
        x = x * tl.load(xs_ptr + g, mask=g_ok, other=0.0)[:, None]
        w = tl.load(w_rows + offs_k[None, :, :], mask=n_ok[:, None, None] & g_ok[None, :, None], other=0.0)
        s = tl.load(ws_rows + g[None, :], mask=n_ok[:, None] & g_ok[None, :], other=0.0)  # [BLOCK_N, R]
        acc += w.to(tl.float32) * x[None, :, :] * s[:, :, None]
    y = tl.sum(tl.sum(acc, 2), 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def gemv_config(n: int, k: int, block: bool) -> dict:
    """Untuned starting points (the H200 sweep of benchmarks/fp8_linear.py --sweep decides): the
    bf16 reduce GEMV's best tiles held the same bytes in flight per program, and an e4m3 value is
    half a bf16 one, so the K tile doubles; block scales step 8 groups of 128 on 4 rows (the same
    4 KiB a step)."""
    if block:
        return dict(block_n=4, groups_per_step=8, num_warps=4)
    if n <= 4096:
        return dict(block_n=2, block_k=4096, num_warps=8)
    return dict(block_n=2, block_k=2048, num_warps=4)


def fp8_gemv(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    block: tuple[int, int] | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    groups_per_step: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 4,
) -> torch.Tensor:
    """atomc::fp8_gemm (block None) or atomc::fp8_block_gemm (block = (bn, bk)) for one row
    xq [..., K] (one row in all); the keywords are tuning knobs, defaults from gemv_config."""
    n, k = weight.shape
    if xq.numel() != k or weight.stride(-1) != 1:
        raise ValueError(f"fp8_gemv takes one row and a row-major weight; got x {tuple(xq.shape)}")
    cfg = gemv_config(n, k, block is not None)
    block_n = block_n or cfg["block_n"]
    num_warps = num_warps or cfg["num_warps"]
    x = xq.reshape(k)
    x = x if x.stride(0) == 1 else x.contiguous()
    y = torch.empty(n, dtype=out_dtype, device=xq.device)
    b = bias if bias is not None else y
    grid = (triton.cdiv(n, block_n),)
    if block is None:
        block_k = min(block_k or cfg["block_k"], triton.next_power_of_2(k))
        ws = weight_scale.float().reshape(-1)
        _fp8_gemv_kernel[grid](
            x, x_scale.float().reshape(-1), weight, ws, b, y, n, k, weight.stride(0), 0,
            WS_ROWS=ws.numel() > 1, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    else:
        bn, bk = block
        if k % bk or bk & (bk - 1):
            raise ValueError(f"fp8_gemv: block columns {bk} must be a power of two dividing K = {k}")
        r = min(groups_per_step or cfg["groups_per_step"], triton.next_power_of_2(k // bk))
        ws = weight_scale.float()
        _fp8_block_gemv_kernel[grid](
            x, x_scale.float().reshape(-1), weight, ws, b, y, n, k, weight.stride(0), ws.stride(0), bn,
            HAS_BIAS=bias is not None, BLOCK_N=block_n, R=r, GROUP_K=bk, num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    return y.view(*xq.shape[:-1], n)
