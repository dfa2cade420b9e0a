"""What a canonicalisation pattern is, plus graph-editing helpers the patterns share."""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
from torch.fx import Node


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
        matched = rewritten = 0
        for node in list(gm.graph.nodes):
            if node.graph is None:  # erased by an earlier rewrite
                continue
            m = self.match(node)
            if m is None:
                continue
            matched += 1
            rewritten += bool(self.replace(gm, m))
        return matched, rewritten


def call(graph: torch.fx.Graph, target, args: tuple, example_value=None) -> Node:
    node = graph.call_function(target, args)
    if example_value is not None:
        node.meta["example_value"] = example_value
    return node


def getitems(graph: torch.fx.Graph, node: Node, values: Iterable) -> list[Node]:
    """`node[i]` for each output of a multi-output op, carrying each output's example value."""
    out = []
    for i, v in enumerate(values):
        g = graph.call_function(operator.getitem, (node, i))
        if v is not None:
            g.meta["example_value"] = v
        out.append(g)
    return out


def erase_dead(graph: torch.fx.Graph, nodes: Iterable[Node]) -> None:
    """Erase the given nodes once they have no users, last first. Only matched nodes are touched:
    generic DCE would also drop mutating ops whose result is unused (atomc::attention)."""
    pending = [n for n in nodes if n is not None]
    progress = True
    while progress:
        progress = False
        for n in list(reversed(pending)):
            if n.graph is not None and not n.users:
                graph.erase_node(n)
                pending.remove(n)
                progress = True


def single_use(nodes: Iterable[Node], allowed: Iterable[Node]) -> bool:
    """Each node is used only by nodes of the pattern (so removing the pattern removes them)."""
    allowed = set(allowed)
    return all(set(n.users) <= allowed for n in nodes)
