"""Joining the engine's ranks: torch.distributed, the "tp" group, the step channel.

Every rank (the driver, rank 0, and each worker) calls `join`: the world group is the "tp" group the
layers' collectives use (NCCL on CUDA, gloo on CPU), or, with tensor parallelism inside pipeline
stages, each stage's own group of its tensor-parallel ranks, registered as "tp" in each of its
processes; a second, gloo group carries the step records from the driver (CPU tensors, so a record
never waits behind GPU work). The timeout bounds every collective: a rank that stops answering fails
the others instead of hanging them.
"""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from atomc.config import ParallelConfig
from atomc.ops import collective
from models.layers.parallel import ParallelInfo


def world_size(par: ParallelConfig) -> int:
    """Every rank of the engine: tensor-parallel ranks times pipeline stages."""
    return par.tensor_parallel_size * par.pipeline_parallel_size


def parallel_info(par: ParallelConfig) -> ParallelInfo:
    """The layers' shard of this process's world rank (`par.rank`: 0 on the driver, set on each
    worker): its pipeline stage and its tensor-parallel rank inside it (world rank = stage * T +
    tensor-parallel rank; models/layers/parallel.py says why)."""
    return ParallelInfo.of_world_rank(
        par.rank, par.tensor_parallel_size, par.pipeline_parallel_size, par.enable_expert_parallel
    )


def world_flags(par: ParallelConfig) -> str:
    """The flags that ask for the world, for error messages."""
    if par.pipeline_parallel_size == 1:
        return "--tensor-parallel-size"
    if par.tensor_parallel_size == 1:
        return "--pipeline-parallel-size"
    return "--tensor-parallel-size x --pipeline-parallel-size"


def rank_device(device: str, rank: int) -> str:
    """Rank `rank`'s device: cuda:rank on CUDA, cpu on CPU."""
    return f"cuda:{rank}" if device.startswith("cuda") else "cpu"


def check_world(device: str, size: int, what: str = "--tensor-parallel-size") -> None:
    """Clear errors for a world the machine cannot hold (`what`: the flag that asked for it)."""
    if size < 1:
        raise ValueError(f"{what} must be at least 1, got {size}")
    if device.startswith("cuda"):
        if device not in ("cuda", "cuda:0"):
            raise ValueError(f"{what} {size} places rank r on cuda:r; give --device cuda, not {device}")
        have = torch.cuda.device_count()
        if size > have:
            raise ValueError(f"{what} {size} needs {size} GPUs, this machine has {have}")


def local_init_method() -> str:
    """A TCP rendezvous on a free local port, for ranks that one process spawns."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def join(
    rank: int, size: int, device: str, init_method: str, timeout_s: float, tp_size: int | None = None
) -> dist.ProcessGroup:
    """Join the world as `rank`; returns the gloo group the step records travel on. With pipeline
    stages of `tp_size` < `size` ranks each, "tp" is this rank's stage's group (the ranks
    stage * tp_size .. + tp_size - 1), else the world."""
    timeout = datetime.timedelta(seconds=timeout_s)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=size, timeout=timeout
    )
    collective.set_group("tp", None)  # the world group
    tp_size = size if tp_size is None else tp_size
    if 1 < tp_size < size:
        # every rank makes every stage's group, in stage order (new_group is collective over the
        # world), and registers its own under the name the layers' collectives ask for
        for stage in range(size // tp_size):
            ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                collective.set_group("tp", group)
    return dist.new_group(backend="gloo", timeout=timeout)


def leave() -> None:
    collective.clear_groups()
    if dist.is_initialized():
        dist.destroy_process_group()


def min_across_ranks(values: list[int], device: str) -> list[int]:
    """Each value's minimum over every rank of the world, tensor-parallel ranks and pipeline
    stages alike (the KV block counts: the one scheduler's block ids address every rank's pools)."""
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.tolist()


def same_across_ranks(value: int, device: str) -> bool:
    """Whether every rank of the world holds the same `value` (one all-reduce of value and -value)."""
    t = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    low, neg_high = t.tolist()
    return low == -neg_high


def broadcast_tokens(tokens: torch.Tensor | None, count: int, device: str) -> torch.Tensor:
    """The driver's sampled ids of a step on every rank (workers feed them to the next step's
    inputs, as the driver does). `tokens` on rank 0; None on a worker, which receives `count` ids."""
    buf = torch.empty(count, dtype=torch.long, device=device) if tokens is None else tokens.to(torch.long).contiguous()
    dist.broadcast(buf, src=0, group=collective.group("tp"))
    return buf
