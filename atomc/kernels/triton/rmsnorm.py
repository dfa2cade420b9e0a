"""RMSNorm and fused residual-add + RMSNorm, one row per program.

Rounding follows HF: normalize in fp32, cast to the input dtype, then multiply by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomc.kernels.triton import pdl
from atomc.kernels.triton.pdl import after_producer


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    n_cols, eps,
    ADD: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: before the wait (pdl.py)
    after_producer(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # residual rounds to dtype
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    y = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    assert t2.stride(-1) == 1
    return t2


def _launch(x, residual, weight, eps, out, residual_out):
    n = x.shape[-1]
    x2, o2 = _rows(x), _rows(out)
    add = residual is not None
    r2 = _rows(residual) if add else x2
    ro2 = _rows(residual_out) if add else o2
    if x2.shape[0] == 0:
        return
    block_n = triton.next_power_of_2(n)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, o2, ro2,
        x2.stride(0), r2.stride(0), o2.stride(0), ro2.stride(0),
        n, eps,
        ADD=add, BLOCK_N=block_n, num_warps=min(16, max(1, block_n // 512)), **pdl.launch(x2),
    )  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., N] -> weight * (x * rsqrt(mean(x^2) + eps)) in x.dtype."""
    out = torch.empty_like(x) if out is None else out
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rms_norm(x + residual), x + residual). Passing out=x, residual_out=residual works in place
    (each program reads its whole row before writing it)."""
    out = torch.empty_like(x) if out is None else out
    residual_out = torch.empty_like(x) if residual_out is None else residual_out
    _launch(x, residual, weight, eps, out, residual_out)
    return out, residual_out
