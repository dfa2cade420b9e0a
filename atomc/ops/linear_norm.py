"""A linear whose output goes only into the residual add + RMSNorm after it, as one op.

    linear_add_rms_norm(x, weight, bias, residual, norm_weight, eps) -> (normed, summed)
      = fused_add_rms_norm(linear(x, weight, bias), residual, norm_weight, eps)
    fp8_linear_add_rms_norm_quant(x, group_size, weight, weight_scale, bias, out_dtype, silu_and_mul,
                                  residual, norm_weight, eps, out_group_size) -> (q, scale, summed)
      = fused_add_rms_norm_fp8_quant_dynamic(
            fp8_linear_dynamic(x, group_size, weight, weight_scale, bias, out_dtype, silu_and_mul),
            residual, norm_weight, eps, out_group_size)

The pass `fuse_linear_add_rmsnorm` rewrites the o projection (and a dense MLP's down projection)
with the norm after it to these. The reference bodies are those compositions, so a rewritten graph
gives the same numbers on the torch backend. Owning the norm lets a backend run it inside the
linear: at one row the CUDA backend's GEMV does the add and the norm (and the FP8 quant) in its
last program to finish, one launch fewer a norm (atomc/kernels/triton/gemv_norm.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atomc.ops.fp8 import fp8_quant_dynamic_reference
from atomc.ops.fp8_fused import _check_group, _fake_q, _fake_scale
from atomc.ops.fp8_linear import fp8_linear_dynamic_reference
from atomc.ops.norm import rms_norm_reference


def linear_add_rms_norm_reference(x, weight, bias, residual, norm_weight, eps):
    summed = F.linear(x, weight, bias) + residual
    return rms_norm_reference(summed, norm_weight, eps), summed


def fp8_linear_add_rms_norm_quant_reference(
    x, group_size, weight, weight_scale, bias, out_dtype, silu_and_mul, residual, norm_weight, eps, out_group_size
):
    _check_group(out_group_size, weight.shape[0], "fp8_linear_add_rms_norm_quant")
    y = fp8_linear_dynamic_reference(x, group_size, weight, weight_scale, bias, out_dtype, silu_and_mul)
    summed = y + residual
    q, scale = fp8_quant_dynamic_reference(rms_norm_reference(summed, norm_weight, eps), out_group_size)
    return q, scale, summed


@torch.library.custom_op("atomc::linear_add_rms_norm", mutates_args=())
def linear_add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return linear_add_rms_norm_reference(x, weight, bias, residual, norm_weight, eps)


@linear_add_rms_norm.register_fake
def _(x, weight, bias, residual, norm_weight, eps):
    summed = torch.empty_like(residual)
    return torch.empty_like(residual, dtype=torch.promote_types(residual.dtype, norm_weight.dtype)), summed


@torch.library.custom_op("atomc::fp8_linear_add_rms_norm_quant", mutates_args=())
def fp8_linear_add_rms_norm_quant(
    x: torch.Tensor,
    group_size: int,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    silu_and_mul: bool,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    out_group_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return fp8_linear_add_rms_norm_quant_reference(
        x, group_size, weight, weight_scale, bias, out_dtype, silu_and_mul, residual, norm_weight, eps, out_group_size
    )


@fp8_linear_add_rms_norm_quant.register_fake
def _(x, group_size, weight, weight_scale, bias, out_dtype, silu_and_mul, residual, norm_weight, eps, out_group_size):
    return _fake_q(residual), _fake_scale(residual, out_group_size), torch.empty_like(residual)


LINEAR_NORM_OPS = ("linear_add_rms_norm", "fp8_linear_add_rms_norm_quant")
