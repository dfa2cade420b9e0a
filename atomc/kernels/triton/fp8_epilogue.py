"""The scale epilogue of fp8_gemm's `scaled_mm_unit` route (atomc/kernels/triton/fp8.py):
out[m, n] = (acc[m, n] * x_scale[m] * w_scale[n] (+ bias[n])).to(out_dtype).

`acc` is torch._scaled_mm's tensorwise product with unit scales and an fp32 output: the e4m3 dot
accumulated in fp32, unscaled (a sum of e4m3 products cannot overflow fp32). Scaling it here in
fp32 and rounding once to out_dtype is the math of _scaled_mm's rowwise mode and of the Triton row
GEMM's epilogue (fp8_gemm.py): fp32 accumulation, the scales applied in fp32, one rounding, the bias
added before it. Either scale may be one value ([1], broadcast over its dimension) or one per row
(x_scale, [M]) / per output column (w_scale, [N]).

One program scales a BLOCK_M x BLOCK_N tile; it reads the weight's scales and bias (model weights,
written by no kernel of the step) before `after_producer`, then the activation's scales and the
product (pdl.py). Runs on CPU tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomc.kernels.triton import pdl
from atomc.kernels.triton.pdl import after_producer

BLOCK_M = 16
BLOCK_N = 128  # 16 x 128: 32 programs at M = 16, N = 4096; memory-bound, so no tuning table


@triton.jit
def _scale_epilogue_kernel(
    acc_ptr, xs_ptr, ws_ptr, bias_ptr, out_ptr, M, N, stride_am, stride_om,
    X_ROWS: tl.constexpr, W_COLS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    # the weight's scales and bias: model weights, loaded before the wait (pdl.py)
    if W_COLS:
        ws = tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    else:
        ws = tl.load(ws_ptr).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    after_producer(PDL)
    if X_ROWS:
        xs = tl.load(xs_ptr + offs_m, mask=m_ok, other=0.0).to(tl.float32)[:, None]
    else:
        xs = tl.load(xs_ptr).to(tl.float32)
    ok = m_ok[:, None] & n_ok[None, :]
    acc = tl.load(acc_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_n[None, :], mask=ok, other=0.0)
    out = acc * xs * ws
    if HAS_BIAS:
        out += bias[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=ok)


def scale_epilogue(
    acc: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """acc [M, N] fp32 (rows unit-strided) scaled by x_scale ([1] or M values: [M], [M, 1], [..., 1])
    and w_scale ([1] or N values), plus bias [N], rounded once to out_dtype: a new [M, N] tensor."""
    m, n = acc.shape
    if acc.stride(-1) != 1:
        acc = acc.contiguous()
    xs = x_scale.reshape(-1)
    ws = w_scale.reshape(-1)
    if xs.numel() not in (1, m) or ws.numel() not in (1, n):
        shapes = f"x_scale {tuple(x_scale.shape)}, w_scale {tuple(w_scale.shape)}"
        raise ValueError(f"fp8 scale epilogue: {shapes} for a [{m}, {n}] product")
    xs = xs if xs.stride(0) == 1 else xs.contiguous()
    ws = ws if ws.stride(0) == 1 else ws.contiguous()
    out = torch.empty(m, n, dtype=out_dtype, device=acc.device)
    if m == 0 or n == 0:
        return out
    if bias is not None and bias.stride(-1) != 1:
        bias = bias.contiguous()
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _scale_epilogue_kernel[grid](
        acc, xs, ws, bias if bias is not None else out, out, m, n, acc.stride(0), out.stride(0),
        X_ROWS=xs.numel() > 1, W_COLS=ws.numel() > 1,
        HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=4, **pdl.launch(acc),
    )  # fmt: skip
    return out
