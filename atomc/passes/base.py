"""The pass contract: a named FX rewrite whose uuid (name, platform, source) feeds the compile cache key."""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass
from pathlib import Path

import torch

from atomc.passes import match, rewrite


@dataclass
class PassResult:
    matched: int
    rewritten: int
    notes: str = ""


class AtomcPass:
    """Subclasses set `name` (stable: `--disable-pass NAME` and reports use it) and implement `__call__`."""

    name: str = ""
    platform: str | None = None  # set by passes whose rewrite depends on the platform

    def source_files(self) -> list[Path]:
        """The files whose text decides what this pass does: its own file, by default. The cache key
        hashes them (with their project imports) file by file, so `atomc cache diff` names the edit."""
        return [Path(inspect.getsourcefile(type(self))).resolve()]

    def uuid(self) -> str:
        # the same value in every process for the same pass, platform and source text; a pass
        # defined outside the project (a plugin, a test) is covered here, where `sources` cannot see it
        h = hashlib.sha256(f"{self.name}\0{self.platform or ''}".encode())
        for path in sorted(set(self.source_files())):
            h.update(b"\0" + path.name.encode() + b"\0" + path.read_bytes())
        return h.hexdigest()

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class FusionPass(AtomcPass):
    """A rewrite anchored at calls of one op (`anchor`: a target, a tuple of them, or a match.OPS
    name). For each call, `match(node)` returns what the rewrite needs, or None when this call is
    not the pattern (not counted); `rewrite(gm, m)` edits the graph and returns False when it
    declines a match (counted as matched, not rewritten)."""

    anchor: object = None

    def match(self, node: torch.fx.Node):
        return node

    def rewrite(self, gm: torch.fx.GraphModule, m) -> bool:
        raise NotImplementedError

    def notes(self) -> str:
        return ""

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        matched, rewritten = rewrite.rewrite_each(gm, match.calls(gm, self.anchor), self.match, self.rewrite)
        return PassResult(matched, rewritten, self.notes())
