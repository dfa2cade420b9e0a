"""Which tensor-parallel shard this process holds: a plain (rank, size) value passed down by the builder.

Layers take it explicitly instead of reading a global process group, so sharding is a pure function
of (rank, size): a test can load rank 1 of 2 in a single process and check the slices. With size 1
every layer holds the whole tensor and no collective enters the traced graph; with size > 1 the
layers whose outputs are partial sums or slices call the collective ops (atomc/ops/collective.py)
on the process group named `group`, which atomc's workers set up.

`expert_parallel` (`--enable-expert-parallel`): MoE layers split their experts across these ranks
instead of each expert's intermediate size (attention and dense MLPs stay tensor-parallel).

`stage` of `stages` (pipeline parallelism): this process builds and loads only its contiguous run
of decoder layers (`stage_layers`), the first stage the embedding, the last the final norm and the
LM head; the hidden states between stages are the caller's to pass.

Both at once (`-tp T -pp P`): the engine's T x P processes are laid out stage-major, world rank =
stage * T + tensor-parallel rank (`of_world_rank`, `world_rank`), so a stage's tensor-parallel ranks
are neighbours: torchrun gives each node a contiguous run of ranks, so with T ranks a node each
stage's all-reduces stay inside one machine and only the stage-to-stage sends cross machines.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import atomc.ops  # noqa: F401  (registers torch.ops.atomc.all_reduce / all_gather)


@dataclass(frozen=True)
class ParallelInfo:
    rank: int = 0
    size: int = 1
    group: str = "tp"
    expert_parallel: bool = False
    stage: int = 0
    stages: int = 1

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of size {self.size} is not valid")
        if self.stages < 1 or not 0 <= self.stage < self.stages:
            raise ValueError(f"pipeline stage {self.stage} of {self.stages} is not valid")

    @classmethod
    def of_world_rank(cls, rank: int, tp_size: int, stages: int = 1, expert_parallel: bool = False) -> ParallelInfo:
        """The place of world rank `rank` of an engine of `tp_size` x `stages` ranks (stage-major)."""
        return cls(rank % tp_size, tp_size, expert_parallel=expert_parallel, stage=rank // tp_size, stages=stages)

    def world_rank(self, stage: int, tp_rank: int | None = None) -> int:
        """The world rank of tensor-parallel rank `tp_rank` (None: this one's) of pipeline stage `stage`."""
        return stage * self.size + (self.rank if tp_rank is None else tp_rank)

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.stages - 1

    def stage_layers(self, num_layers: int) -> range:
        """This stage's decoder layers: contiguous runs whose lengths differ by at most one, the
        longer ones first (the last stage also runs the LM head)."""
        if num_layers < self.stages:
            raise ValueError(f"{num_layers} decoder layers cannot fill {self.stages} pipeline stages")
        base, extra = divmod(num_layers, self.stages)
        start = self.stage * base + min(self.stage, extra)
        return range(start, start + base + (self.stage < extra))

    def split(self, total: int, what: str) -> int:
        """The per-rank part of `total` (heads, features, ...), or a clear error if it does not divide."""
        if total % self.size:
            raise ValueError(f"{what} = {total} does not divide across {self.size} tensor-parallel ranks")
        return total // self.size


SINGLE = ParallelInfo()


def all_reduce(parallel: ParallelInfo, x: torch.Tensor) -> torch.Tensor:
    """The sum of the ranks' partial x; with size 1, x itself (no node in the graph)."""
    return x if parallel.size == 1 else torch.ops.atomc.all_reduce(x, parallel.group)


def all_gather(parallel: ParallelInfo, x: torch.Tensor, dim: int) -> torch.Tensor:
    """The ranks' slices of x joined along `dim`; with size 1, x itself."""
    return x if parallel.size == 1 else torch.ops.atomc.all_gather(x, dim, parallel.group)
