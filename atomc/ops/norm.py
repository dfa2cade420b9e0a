"""`atomc::rms_norm` and `atomc::fused_add_rms_norm`: canonical RMSNorm ops the passes rewrite to.

The reference bodies repeat models.layers.norm.RMSNorm op for op (fp32 statistics, cast back, then the
weight), so a rewritten graph gives bit-identical results on the torch backend.
"""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


@torch.library.custom_op("atomc::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] -> weight * normalise(x) over the last dim."""
    return rms_norm_reference(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.custom_op("atomc::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rms_norm(x + residual), x + residual): the residual stream update and the next norm in one op."""
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    summed = torch.empty_like(x)
    return torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype)), summed
