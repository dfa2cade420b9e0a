"""A per-token FP8 linear that owns its activation quant: `fp8_linear_dynamic`.

    fp8_linear_dynamic(x, group_size, weight, weight_scale, bias, out_dtype, silu_and_mul) -> [..., N]
      = fp8_gemm(*fp8_quant_dynamic(a, group_size), weight, weight_scale, bias, out_dtype)
        with a = silu_and_mul(x) when `silu_and_mul`, else x

The pass `fuse_fp8_quant_linear` rewrites a per-token quant read by one `fp8_gemm` (the o
projection's input, and the down projection's after `fuse_silu_mul_fp8_quant`) to this op. The
reference body is that composition, so a rewritten graph gives the same numbers on the torch
backend. Owning the quant lets a backend skip it where it costs more than it saves: at one row the
CUDA backend can multiply the bf16 activation with the e4m3 weights directly (W8A16, one GEMV, no
quant kernel; atomc/kernels/triton/fp8.py's ONE_ROW_W8A16), which drops one launch a linear and
rounds less. Timed on an H100 it was slower end to end (its fp32 GEMV loop), so it is off and the
backend runs the quant and the GEMM (docs/quantization.md).
"""

from __future__ import annotations

import torch

from atomc.ops.fp8 import fp8_gemm_reference, fp8_quant_dynamic_reference
from atomc.ops.fp8_fused import silu_and_mul_reference


def fp8_linear_dynamic_reference(x, group_size, weight, weight_scale, bias, out_dtype, silu_and_mul):
    """The op's body as a plain function (a backend's fallback calls it without dispatching)."""
    a = silu_and_mul_reference(x) if silu_and_mul else x
    if group_size <= 0 or a.shape[-1] % group_size:
        raise ValueError(f"fp8_linear_dynamic: group size {group_size} must divide the row length {a.shape[-1]}")
    q, s = fp8_quant_dynamic_reference(a, group_size)
    return fp8_gemm_reference(q, s, weight, weight_scale, bias, out_dtype)


@torch.library.custom_op("atomc::fp8_linear_dynamic", mutates_args=())
def fp8_linear_dynamic(
    x: torch.Tensor,
    group_size: int,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    silu_and_mul: bool,
) -> torch.Tensor:
    return fp8_linear_dynamic_reference(x, group_size, weight, weight_scale, bias, out_dtype, silu_and_mul)


@fp8_linear_dynamic.register_fake
def _(x, group_size, weight, weight_scale, bias, out_dtype, silu_and_mul):
    return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=out_dtype)
