"""SwiGLU ops: `atomc::silu_mul(gate, up)` (canonical form, two tensors) and
`atomc::silu_and_mul(x)` (fused form on the merged gate_up output, x = cat(gate, up) on the last dim)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("atomc::silu_mul", mutates_args=())
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@silu_mul.register_fake
def _(gate, up):
    return torch.empty_like(gate, dtype=torch.promote_types(gate.dtype, up.dtype))


@torch.library.custom_op("atomc::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> silu(x[..., :I]) * x[..., I:]; one read of the GEMM output, no split views."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@silu_and_mul.register_fake
def _(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
