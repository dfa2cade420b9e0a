"""FP8 GEMM on tensor cores: C[M, N] = A_e4m3[M, K] . B_e4m3[N, K]^T, fp32 accumulation.

Two ways of scaling, the two FP8 GEMM ops:
- block (DeepSeek-V3 style, atomc::fp8_block_gemm): A has one scale per row per group of bk values
  ([M, K/bk], the activation quantised per token group at run time), B one per bn x bk block
  ([ceil(N/bn), K/bk]). A K step (BLOCK_K) lies inside one group (BLOCK_K divides bk), so each
  step's dot is scaled by a_s[m, g] * b_s[n // bn, g] before it is added to the accumulator, which is
  the dequantise-then-multiply of the reference up to fp32 summation order;
- row (atomc::fp8_gemm): A's scale is [1] or per row, B's [1] or per output row; the raw dot is
  accumulated and scaled once in the epilogue (what _scaled_mm's tensorwise / rowwise modes do).
  It covers what _scaled_mm cannot (an fp32 output with row scales, dimensions not multiples of 16)
  and is the Triton side of the _scaled_mm comparison in benchmarks/fp8_linear.py.

Tiles come from `gemm_config(M)`: untuned starting points for the H200, picked by the row count
(the benchmark's sweep is what will tune them). Program ids are grouped GROUP_M rows of tiles at a
time so neighbouring programs share B tiles in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr,
    M, N, K, stride_am, stride_bn, stride_cm, stride_asm, stride_bsn, SCALE_ROWS,
    BLOCK_SCALES: tl.constexpr, A_ROWS: tl.constexpr, B_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
    GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    b_rows = b_ptr + offs_n.to(tl.int64)[:, None] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_rows + (k0 + offs_k)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if BLOCK_SCALES:
            g = k0 // GROUP_K
            a_s = tl.load(as_ptr + offs_m * stride_asm + g, mask=m_ok, other=0.0)
            b_s = tl.load(bs_ptr + (offs_n // SCALE_ROWS) * stride_bsn + g, mask=n_ok, other=0.0)
            acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    if not BLOCK_SCALES:
        if A_ROWS:
            acc = acc * tl.load(as_ptr + offs_m, mask=m_ok, other=0.0)[:, None]
        else:
            acc = acc * tl.load(as_ptr)
        if B_ROWS:
            acc = acc * tl.load(bs_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
        else:
            acc = acc * tl.load(bs_ptr)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gemm_config(m: int) -> dict:
    """Tiles by row count (untuned for the H200; the sweep in benchmarks/fp8_linear.py tunes them)."""
    if m <= 16:
        return dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
    if m <= 64:
        return dict(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4)
    if m <= 512:
        return dict(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=4)
    return dict(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3)


def fp8_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    block: tuple[int, int] | None = None,
    config: dict | None = None,
    group_m: int = 8,
) -> torch.Tensor:
    """atomc::fp8_gemm (block None) or atomc::fp8_block_gemm (block = (bn, bk)) for xq [..., K]
    and a row-major weight [N, K]; `config` overrides gemm_config's tiles."""
    n, k = weight.shape
    a = xq.reshape(-1, k)
    a = a if a.stride(-1) == 1 else a.contiguous()
    m = a.shape[0]
    cfg = {**gemm_config(m), **(config or {})}
    block_k = cfg["block_k"]
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out.view(*xq.shape[:-1], n)
    if block is not None:
        bn, bk = block
        block_k = min(block_k, bk)
        if bk % block_k or k % bk:
            raise ValueError(
                f"fp8 block GEMM: the K step {block_k} must divide the block's {bk} columns, and they K = {k}"
            )
        a_s = x_scale.float().reshape(m, k // bk).contiguous()
        b_s = weight_scale.float().contiguous()
        strides = (a_s.stride(0), b_s.stride(0), bn)
        a_rows = b_rows = False
    else:
        bk = block_k
        a_s, b_s = x_scale.float().reshape(-1), weight_scale.float().reshape(-1)
        strides = (0, 0, 1)
        a_rows, b_rows = a_s.numel() > 1, b_s.numel() > 1
    grid = (triton.cdiv(m, cfg["block_m"]) * triton.cdiv(n, cfg["block_n"]),)
    _fp8_gemm_kernel[grid](
        a, a_s, weight, b_s, bias if bias is not None else out, out,
        m, n, k, a.stride(0), weight.stride(0), out.stride(0), *strides,
        BLOCK_SCALES=block is not None, A_ROWS=a_rows, B_ROWS=b_rows, HAS_BIAS=bias is not None,
        GROUP_K=bk, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=block_k, GROUP_M=group_m,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out.view(*xq.shape[:-1], n)
