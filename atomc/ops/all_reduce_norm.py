"""`atomc::all_reduce_add_rms_norm`: a tensor-parallel all-reduce, the residual add and the next RMSNorm as one op.

    normed, summed = all_reduce_add_rms_norm(x, residual, weight, eps, group_name)
    # == fused_add_rms_norm(all_reduce(x, group_name), residual, weight, eps)

`x` is a rank's partial sum (a row-parallel linear's or a MoE block's output); `summed` is the
residual stream after the add, `normed` the next layer's normalised input. Functional like the two
ops it replaces (nothing is written in place), and with their outputs: the fuse_allreduce_rmsnorm
pass swaps the pair for it. This reference body runs them one after the other (torch.distributed's
all-reduce, then the add and norm as atomc::fused_add_rms_norm computes them), so on the torch
backend a fused graph gives the unfused graph's numbers bit for bit. A backend that can do better
(one kernel reading every rank's partial sum: atomc/kernels/triton/all_reduce_norm.py) keeps this
contract.
"""

from __future__ import annotations

import torch

from atomc.ops.collective import all_reduce
from atomc.ops.norm import fused_add_rms_norm


@torch.library.custom_op("atomc::all_reduce_add_rms_norm", mutates_args=())
def all_reduce_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rms_norm(sum over ranks of x + residual), sum over ranks of x + residual)."""
    return fused_add_rms_norm(all_reduce(x, group_name), residual, weight, eps)


@all_reduce_add_rms_norm.register_fake
def _(x, residual, weight, eps, group_name):
    # the all-reduce's output is contiguous, and the add and norm keep its layout
    summed = torch.empty_like(x, memory_format=torch.contiguous_format)
    return torch.empty_like(summed, dtype=torch.promote_types(x.dtype, weight.dtype)), summed
