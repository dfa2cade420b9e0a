"""The pass contract: a named, versioned FX rewrite whose uuid feeds the compile cache key."""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass

import torch


@dataclass
class PassResult:
    matched: int
    rewritten: int
    notes: str = ""


class AtomcPass:
    """Subclasses set `name` (stable: `--disable-pass NAME` and reports use it) and implement `__call__`."""

    name: str = ""
    version: int = 1
    platform: str | None = None  # set by passes whose rewrite depends on the platform

    def uuid(self) -> str:
        # the source text is part of the id, so editing a pass invalidates cached artifacts
        try:
            source = open(inspect.getsourcefile(type(self)), encoding="utf-8").read()
        except (OSError, TypeError):
            source = inspect.getsource(type(self))
        # a pass that rewrites per platform (self.platform) gives each platform its own id
        payload = f"{self.name}\0{self.version}\0{self.platform or ''}\0{source}".encode()
        return hashlib.sha256(payload).hexdigest()

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, version={self.version})"
