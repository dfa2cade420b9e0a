"""FP8 activation quant fused into the op that makes the activation: RMSNorm and SiLU·mul.

The passes `fuse_rmsnorm_fp8_quant` and `fuse_silu_mul_fp8_quant` rewrite `norm -> fp8_quant_*`
and `silu_and_mul -> fp8_quant_*` to these, so the norm (or activation) output is written once, in
e4m3 with its scale, instead of written in bf16 and read back by a quant kernel. Each op is the
composition it replaces, computed by the same reference bodies, so a rewritten graph gives the same
numbers on the torch backend:

- `rms_norm_fp8_quant_dynamic(x, weight, eps, group_size) -> (q, scale)`
- `rms_norm_fp8_quant_static(x, weight, eps, scale) -> q`
- `fused_add_rms_norm_fp8_quant_dynamic(x, residual, weight, eps, group_size) -> (q, scale, x + residual)`
- `fused_add_rms_norm_fp8_quant_static(x, residual, weight, eps, scale) -> (q, x + residual)`
- `silu_and_mul_fp8_quant_dynamic(x, group_size) -> (q, scale)`   (x = cat(gate, up))
- `silu_and_mul_fp8_quant_static(x, scale) -> q`

`group_size` is fp8_quant_dynamic's: K (one scale per token) or a divisor of K (per group). 0 (one
scale for the whole tensor) is not offered: a row-parallel kernel cannot know the tensor's amax, so
the passes leave that quant alone. Static variants return no scale: the GEMM reads the checkpoint's.
Kernels: atomc/kernels/triton/fp8_quant.py (CUDA), atomc/kernels/aiter/fp8.py (ROCm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atomc.ops.fp8 import FP8_DTYPE, dynamic_scale_shape, to_fp8
from atomc.ops.fp8 import fp8_quant_dynamic_reference as fp8_quant_dynamic
from atomc.ops.norm import rms_norm_reference


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """atomc::silu_and_mul's body (x = cat(gate, up) on the last dim)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _check_group(group_size: int, k: int, op: str) -> None:
    if group_size <= 0 or k % group_size:
        raise ValueError(f"{op}: group size {group_size} must be positive and divide the row length {k}")


def _fake_q(x, k=None):
    shape = (*x.shape[:-1], x.shape[-1] if k is None else k)
    return x.new_empty(shape, dtype=FP8_DTYPE)


def _fake_scale(x, group_size, k=None):
    shape = (*x.shape[:-1], x.shape[-1] if k is None else k)
    return x.new_empty(dynamic_scale_shape(shape, group_size), dtype=torch.float32)


@torch.library.custom_op("atomc::rms_norm_fp8_quant_dynamic", mutates_args=())
def rms_norm_fp8_quant_dynamic(
    x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_group(group_size, x.shape[-1], "rms_norm_fp8_quant_dynamic")
    return fp8_quant_dynamic(rms_norm_reference(x, weight, eps), group_size)


@rms_norm_fp8_quant_dynamic.register_fake
def _(x, weight, eps, group_size):
    return _fake_q(x), _fake_scale(x, group_size)


@torch.library.custom_op("atomc::rms_norm_fp8_quant_static", mutates_args=())
def rms_norm_fp8_quant_static(x: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor) -> torch.Tensor:
    return to_fp8(rms_norm_reference(x, weight, eps), scale.float())


@rms_norm_fp8_quant_static.register_fake
def _(x, weight, eps, scale):
    return _fake_q(x)


@torch.library.custom_op("atomc::fused_add_rms_norm_fp8_quant_dynamic", mutates_args=())
def fused_add_rms_norm_fp8_quant_dynamic(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_group(group_size, x.shape[-1], "fused_add_rms_norm_fp8_quant_dynamic")
    summed = x + residual
    q, scale = fp8_quant_dynamic(rms_norm_reference(summed, weight, eps), group_size)
    return q, scale, summed


@fused_add_rms_norm_fp8_quant_dynamic.register_fake
def _(x, residual, weight, eps, group_size):
    return _fake_q(x), _fake_scale(x, group_size), torch.empty_like(x)


@torch.library.custom_op("atomc::fused_add_rms_norm_fp8_quant_static", mutates_args=())
def fused_add_rms_norm_fp8_quant_static(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return to_fp8(rms_norm_reference(summed, weight, eps), scale.float()), summed


@fused_add_rms_norm_fp8_quant_static.register_fake
def _(x, residual, weight, eps, scale):
    return _fake_q(x), torch.empty_like(x)


@torch.library.custom_op("atomc::silu_and_mul_fp8_quant_dynamic", mutates_args=())
def silu_and_mul_fp8_quant_dynamic(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check_group(group_size, x.shape[-1] // 2, "silu_and_mul_fp8_quant_dynamic")
    return fp8_quant_dynamic(silu_and_mul_reference(x), group_size)


@silu_and_mul_fp8_quant_dynamic.register_fake
def _(x, group_size):
    inter = x.shape[-1] // 2
    return _fake_q(x, inter), _fake_scale(x, group_size, inter)


@torch.library.custom_op("atomc::silu_and_mul_fp8_quant_static", mutates_args=())
def silu_and_mul_fp8_quant_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return to_fp8(silu_and_mul_reference(x), scale.float())


@silu_and_mul_fp8_quant_static.register_fake
def _(x, scale):
    return _fake_q(x, x.shape[-1] // 2)


FUSED_QUANT_OPS = (
    "rms_norm_fp8_quant_dynamic",
    "rms_norm_fp8_quant_static",
    "fused_add_rms_norm_fp8_quant_dynamic",
    "fused_add_rms_norm_fp8_quant_static",
    "silu_and_mul_fp8_quant_dynamic",
    "silu_and_mul_fp8_quant_static",
)
