"""Which tensor-parallel shard this process holds: a plain (rank, size) value passed down by the builder.

Layers take it explicitly instead of reading a global process group, so sharding is a pure function
of (rank, size): a test can load rank 1 of 2 in a single process and check the slices. With size 1
(today's only runtime setting) every layer holds the whole tensor and no collective is needed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelInfo:
    rank: int = 0
    size: int = 1

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of size {self.size} is not valid")

    def split(self, total: int, what: str) -> int:
        """The per-rank part of `total` (heads, features, ...), or a clear error if it does not divide."""
        if total % self.size:
            raise ValueError(f"{what} = {total} does not divide across {self.size} tensor-parallel ranks")
        return total // self.size


SINGLE = ParallelInfo()


def needs_all_reduce(parallel: ParallelInfo, layer: str) -> None:
    """Layers whose output is a partial sum (or a vocab slice) call this in forward: with size 1 it is
    a constant no-op that leaves the traced graph untouched; the collective itself comes with TP."""
    if parallel.size > 1:
        raise NotImplementedError(
            f"{layer} with tensor-parallel size {parallel.size} needs a collective atomc does not have yet; "
            "loading sharded weights works, running them does not"
        )
