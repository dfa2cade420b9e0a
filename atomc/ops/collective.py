"""`atomc::all_reduce` and `atomc::all_gather`: the tensor-parallel collectives as ops the compiler sees.

A row-parallel linear's output (and a MoE block's, and a vocab-parallel embedding's) is a partial
sum; a vocab-parallel LM head's logits are a slice. The layers call these two ops, so a traced
graph holds one opaque node per collective: partitioning and CUDA-graph capture treat it like any
other op, and a pass can match it (all-reduce + residual add + RMSNorm, later).

Each op names its process group by a string (the graph holds strings, not group objects, so a
cached artifact loads in another process). The worker that joins torch.distributed registers its
groups here (`set_group`) before the model runs; an unregistered name is a clear error. The bodies
are torch.distributed's own collectives (NCCL on CUDA, gloo on CPU), out of place: the ops are
functional, as the compiler wants them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_GROUPS: dict[str, dist.ProcessGroup | None] = {}


def set_group(name: str, group: dist.ProcessGroup | None) -> None:
    """Register `group` (None: the default world group) under `name` for the ops in this process."""
    _GROUPS[name] = group


def clear_groups() -> None:
    _GROUPS.clear()


def group(name: str) -> dist.ProcessGroup | None:
    if name not in _GROUPS or not dist.is_initialized():
        raise RuntimeError(
            f"collective group {name!r} is not set up in this process: a tensor-parallel model runs "
            "only inside atomc's workers (torch.distributed initialised, atomc.ops.collective.set_group)"
        )
    return _GROUPS[name]


@torch.library.custom_op("atomc::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of x over the group's ranks (every rank gets it)."""
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group(group_name))
    return out


@all_reduce.register_fake
def _(x, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("atomc::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """The ranks' x concatenated along `dim`, in rank order (every rank gets it)."""
    g = group(group_name)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(g))]
    dist.all_gather(parts, x, group=g)
    return torch.cat(parts, dim=dim)


@all_gather.register_fake
def _(x, dim, group_name):
    size = list(x.shape)
    size[dim] *= dist.get_world_size(group(group_name))
    return x.new_empty(size)
