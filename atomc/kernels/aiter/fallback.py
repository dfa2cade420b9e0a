"""ROCm's next backend for the calls an AITER op declines. The kernel registry owns the backends'
order and hands each AITER module its fallback when it loads the module (`set_next_backend`), so
these modules never import the registry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class NextBackend:
    """A module's fallback: `set` once by the registry, then called with the op's own arguments."""

    def __init__(self, ops: str):
        self.ops = ops  # what the error names, e.g. "atomc_aiter::moe"
        self.fn: Callable | None = None

    def set(self, fn: Callable) -> None:
        self.fn = fn

    def __call__(self, *args) -> Any:
        if self.fn is None:
            raise RuntimeError(f"{self.ops} is loaded through atomc.kernels.registry, which sets its fallback")
        return self.fn(*args)
