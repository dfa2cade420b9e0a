"""Skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for M <= 16, bandwidth-bound.

At batch 1 the 8B model's time is its weight reads; cuBLAS reaches 55-74% of HBM bandwidth on the
qkv and o shapes at M = 1 (see docs/kernels.md). Two kernels, both streaming W along K (contiguous,
coalesced) in [BLOCK_N, BLOCK_K] tiles:
- "dot": x's M rows padded to 16 and one tensor-core dot per tile (the padding costs no memory
  traffic); `split_k` > 1 cuts K across programs that add fp32 partial sums with atomics.
- "reduce" (M = 1 only): multiply-add on the CUDA cores into a [BLOCK_N, BLOCK_K] fp32 register
  tile, summed once at the end. No shared-memory staging for a dot operand, and BLOCK_N may go
  below 16, so a small N still gets many programs (loads in flight) without split-K's extra kernels.

`linear` is what the model calls (through `atomc::linear`, on CUDA): the reduce kernel for one row,
where it beat cuBLAS on every 8B shape on the H200 (`benchmarks/kernels_bench.py --only gemv_cold
--sweep`, docs/performance.md), and F.linear (cuBLAS) for everything else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from atomc.kernels.triton import pdl
from atomc.kernels.triton.pdl import after_producer

MAX_M = 16


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_lo = pid_k * k_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        offs_k = k_lo + k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if IEEE:  # fp32 inputs: exact fp32 products, not TF32
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        acc += bias[None, :] * (pid_k == 0).to(tl.float32)  # added by the first K split only
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if ATOMIC:
        tl.atomic_add(y_ptrs, acc, mask=ok)
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def row_dot(
    x_ptr, w_ptr, offs_n, n_ok, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    DOT_DTYPE: tl.constexpr = tl.float32, X_SHIFT: tl.constexpr = 1.0,
):  # fmt: skip
    """[BLOCK_N] fp32: the one row x [K] times the weight rows offs_n, on the CUDA cores into a
    [BLOCK_N, BLOCK_K] register tile summed once at the end (the reduce GEMV's loop; the FP8 GEMV
    runs it on e4m3 weights). The first weight tile is loaded before `after_producer` (pdl.py): it
    streams in while the kernel before this one finishes. DOT_DTYPE: the products' and the tile's
    type (float16: fp8_gemv's packed-f16 loop, x scaled by X_SHIFT into f16's range first)."""
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    after_producer(PDL)
    x = _row_x(x_ptr, offs_k, k_ok, DOT_DTYPE, X_SHIFT)
    acc = w.to(DOT_DTYPE) * x[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = _row_x(x_ptr, offs_k, k_ok, DOT_DTYPE, X_SHIFT)
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(DOT_DTYPE) * x[None, :]
    return tl.sum(acc.to(tl.float32), 1)


@triton.jit
def _row_x(x_ptr, offs_k, k_ok, DOT_DTYPE: tl.constexpr, X_SHIFT: tl.constexpr):
    x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0).to(DOT_DTYPE)
    if X_SHIFT != 1.0:
        x = x * X_SHIFT
    return x


@triton.jit
def _gemv_reduce_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    N, K, stride_wn,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    y = row_dot(x_ptr, w_ptr, offs_n, n_ok, K, stride_wn, BLOCK_N, BLOCK_K, PDL)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block_n: int = 16,
    block_k: int = 512,
    split_k: int = 1,
    num_warps: int = 4,
    num_stages: int = 4,
    kernel: str = "dot",
) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K] with M <= 16 (M = 1 for kernel="reduce") and a
    row-major weight [N, K]. The keywords are tuning knobs (see the module docstring)."""
    m, k = x.shape
    n, k_w = weight.shape
    if m > MAX_M or k != k_w:
        raise ValueError(f"gemv takes x [M<={MAX_M}, K] and weight [N, K]; got {tuple(x.shape)}, {tuple(weight.shape)}")
    assert x.stride(-1) == 1 and weight.stride(-1) == 1
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    if kernel == "reduce":
        if m != 1 or split_k != 1:
            raise ValueError("the reduce gemv takes one row and no split-K")
        y = x.new_empty(1, n)
        _gemv_reduce_kernel[(triton.cdiv(n, block_n),)](
            x, weight, bias if bias is not None else weight, y, n, k, weight.stride(0),
            HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=num_warps, num_stages=num_stages, **pdl.launch(x),
        )  # fmt: skip
        return y
    if kernel != "dot":
        raise ValueError(f"unknown gemv kernel {kernel!r}")
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    atomic = splits > 1
    # split K adds fp32 partial sums into a zeroed buffer; one split writes the output directly
    y = torch.zeros(m, n, dtype=torch.float32, device=x.device) if atomic else x.new_empty(m, n)
    _gemv_kernel[(triton.cdiv(n, block_n), splits)](
        x, weight, bias if bias is not None else weight, y,
        m, n, k, k_per_split,
        x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, ATOMIC=atomic, IEEE=x.dtype == torch.float32,
        BLOCK_M=MAX_M, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return y.to(x.dtype) if atomic else y


def reduce_config(n: int, k: int) -> dict:
    """Tuning of the reduce kernel for a [N, K] weight at one row, from the H200 sweep: two rows per
    program everywhere; longer K tiles over 8 warps when N is small (o, down), where fewer programs
    must each keep more bytes in flight."""
    if n <= 4096:
        return dict(block_n=2, block_k=2048, num_warps=8)
    return dict(block_n=2, block_k=1024, num_warps=4)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the reduce GEMV when x holds one row (decode at batch 1)."""
    k = x.shape[-1]
    if x.numel() != k or weight.dim() != 2 or weight.stride(-1) != 1 or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    y = gemv(x.reshape(1, k).contiguous(), weight, bias, kernel="reduce", **reduce_config(*weight.shape))
    return y.view(*x.shape[:-1], weight.shape[0])
