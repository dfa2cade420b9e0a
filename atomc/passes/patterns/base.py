"""What a canonicalisation pattern is (the graph-editing helpers are in atomc/passes/rewrite.py)."""

from __future__ import annotations

import torch
from torch.fx import Node

from atomc.passes.rewrite import rewrite_each


class Pattern:
    """One torch-level idiom -> one atomc op. `apply` rewrites every match in place and returns
    (matched, rewritten); a match it declines (extra users, wrong dtype) counts only as matched."""

    name: str = ""

    def apply(self, gm: torch.fx.GraphModule) -> tuple[int, int]:
        raise NotImplementedError


class NodePattern(Pattern):
    """A pattern found from one anchor node: `match` returns a record or None, `replace` rewrites it."""

    def match(self, node: Node):
        raise NotImplementedError

    def replace(self, gm: torch.fx.GraphModule, m) -> bool:
        raise NotImplementedError

    def apply(self, gm):
        return rewrite_each(gm, gm.graph.nodes, self.match, self.replace)
