"""`atomc_triton::linear_add_rms_norm` and `atomc_triton::fp8_linear_add_rms_norm_quant` (atomc/ops/linear_norm.py).

At one row, with ONE_ROW_ADD_NORM, the GEMV's last program to finish does the residual add, the
RMSNorm and (FP8) the quant (gemv_norm.py): one launch fewer a fused norm. Otherwise, and where
that kernel does not apply, the two kernels the unfused graph ran: the linear (the reduce GEMV at
one row, fp8_linear_dynamic's quant and GEMM for FP8), then the add + norm (+ quant) kernel.
"""

from __future__ import annotations

import torch

from atomc.kernels import triton as tk
from atomc.kernels.triton import fp8, gemv_norm
from atomc.kernels.triton.ops import custom

# Built on kernels.md's plan "fewer launches a layer at batch 1" and not yet timed on a GPU: off
# until an A/B of the decode step says it pays (the last program reads the row back from L2 after
# every other program has finished, so what it saves is the norm's launch and start).
ONE_ROW_ADD_NORM = False


@custom("linear_add_rms_norm")
def linear_add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    if ONE_ROW_ADD_NORM:
        out = gemv_norm.linear_add_rms_norm(x, weight, bias, residual, norm_weight, eps)
        if out is not None:
            return out
    y = tk.linear(x, weight, bias)
    return tk.fused_add_rms_norm(y.contiguous(), residual.contiguous(), norm_weight, eps)


@custom("fp8_linear_add_rms_norm_quant")
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
    # the fused GEMV where fp8_linear_dynamic would quantise and run the W8A8 GEMV (one row, W8A16 off)
    if ONE_ROW_ADD_NORM and not fp8.ONE_ROW_W8A16 and fp8.pick_gemm(x, weight, block=False) == "gemv":
        if silu_and_mul:
            q, s = fp8.silu_quant_or_reference(x, None, group_size)
        else:
            q, s = fp8.fp8_quant_dynamic(x, group_size)
        out = gemv_norm.fp8_gemv_add_rms_norm_quant(
            q, s, weight, weight_scale, bias, out_dtype, residual, norm_weight, eps, out_group_size
        )
        if out is not None:
            return out
        y = fp8.fp8_gemm(q, s, weight, weight_scale, bias, out_dtype)
    else:
        y = fp8.fp8_linear_dynamic(x, group_size, weight, weight_scale, bias, out_dtype, silu_and_mul)
    return fp8.norm_quant_or_reference(y, residual, norm_weight, eps, None, out_group_size)
