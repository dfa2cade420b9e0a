"""atomc::head_matmul for one token: a GEMV per attention head, all heads in one launch.

MLA's absorbed decode multiplies each head's row by its own small matrix twice a layer (q_nope by
W_UK [nope, kv_lora], the attention output by W_UV [v, kv_lora] transposed; atomc/ops/head_matmul.py).
At batch 1 that is two bmm launches of a few MB each (DeepSeek-V2-Lite: 2 MB, about 3.3 us each on
the H200 in docs/performance.md section 10's profile, 0.18 ms a step); here each is one kernel
over (head, column block) programs that loads its first weight tile before waiting on the kernel
before it (pdl.py), as the dense GEMVs do.

- w [H, N, K] (transpose_w): rows of K contiguous, so a program runs gemv.py's `row_dot` over
  BLOCK_N rows of its head.
- w [H, K, N]: columns contiguous, so a program keeps a [BLOCK_K, BLOCK_N] fp32 tile of products
  (x broadcast down the columns) and sums it over K once at the end.

`ONE_ROW` picks the kernel for one token; off, and for more tokens, the reference's bmm runs. On:
DeepSeek-V2-Lite batch 1 went 376.4 -> 384.3 tok/s with it (H100, one call; performance.md
section 21).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomc.kernels.triton import pdl
from atomc.kernels.triton.gemv import row_dot
from atomc.kernels.triton.pdl import after_producer
from atomc.ops.head_matmul import head_matmul_out, head_matmul_reference

ONE_ROW = True
# default tiles (block_n, block_k cap, num_warps), by whether a rank has at most FEW_HEADS heads (16:
# V2-Lite, and V3 at TP 8) or more (V3's 128 on one GPU): the fastest of benchmarks/head_matmul.py's
# sweep on an H100 (performance.md section 21). The columns kernel wants K (nope, 128) in one tile.
FEW_HEADS = 32
ROWS_TILE = {True: (8, 512, 4), False: (16, 256, 2)}
COLUMNS_TILE = {True: (64, 128, 2), False: (64, 64, 2)}


@triton.jit
def _rows_kernel(
    x_ptr, w_ptr, y_ptr, N, K, stride_xh, stride_wh, stride_wn, stride_yh,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """y[h, n] = sum_k x[h, k] w[h, n, k]."""
    h = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    y = row_dot(x_ptr + h * stride_xh, w_ptr + h * stride_wh, offs_n, n_ok, K, stride_wn, BLOCK_N, BLOCK_K, PDL)
    tl.store(y_ptr + h * stride_yh + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _columns_kernel(
    x_ptr, w_ptr, y_ptr, N, K, stride_xh, stride_wh, stride_wk, stride_yh,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """y[h, n] = sum_k x[h, k] w[h, k, n]."""
    h = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_cols = w_ptr + h * stride_wh + offs_n[None, :]
    x_row = x_ptr + h * stride_xh
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    w = tl.load(w_cols + offs_k.to(tl.int64)[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    after_producer(PDL)  # the first tile streams in while the kernel before finishes
    x = tl.load(x_row + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    acc = w.to(tl.float32) * x[:, None]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_row + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_cols + offs_k.to(tl.int64)[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x[:, None]
    tl.store(y_ptr + h * stride_yh + offs_n, tl.sum(acc, 0).to(y_ptr.dtype.element_ty), mask=n_ok)


def head_matmul(
    x: torch.Tensor, w: torch.Tensor, transpose_w: bool, *, one_row: bool | None = None,
    block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """atomc::head_matmul (same arguments); `one_row` (default ONE_ROW) and the tiles are knobs
    for tests and benchmarks."""
    one_row = ONE_ROW if one_row is None else one_row
    if not one_row or x.shape[0] != 1 or x.stride(-1) != 1 or w.stride(-1) != 1 or x.dtype != w.dtype:
        return head_matmul_reference(x, w, transpose_w)
    heads, k = x.shape[1], x.shape[2]
    y = head_matmul_out(x, w, transpose_w)
    tile_n, tile_k, warps = (ROWS_TILE if transpose_w else COLUMNS_TILE)[heads <= FEW_HEADS]
    bn, bk = block_n or tile_n, block_k or min(tile_k, max(16, triton.next_power_of_2(k)))
    if transpose_w:
        n = w.shape[1]
        assert w.shape == (heads, n, k), f"head_matmul: w {tuple(w.shape)} against x {tuple(x.shape)}"
        kernel = _rows_kernel
    else:
        n = w.shape[2]
        assert w.shape == (heads, k, n), f"head_matmul: w {tuple(w.shape)} against x {tuple(x.shape)}"
        kernel = _columns_kernel
    kernel[(heads, triton.cdiv(n, bn))](
        x, w, y, n, k, x.stride(1), w.stride(0), w.stride(1), y.stride(1),
        BLOCK_N=bn, BLOCK_K=bk, num_warps=num_warps or warps, **pdl.launch(x),
    )  # fmt: skip
    return y
