"""Graph-editing toolkit the passes and patterns share: add calls, unpack outputs, erase what a
rewrite left dead, and the loop that tries a rewrite at each anchor and counts.

New nodes get their `example_value` here by hand (the fake tensor Dynamo would have recorded):
later passes match on shapes and dtypes through it (passes/README.md).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable

import torch
from torch.fx import Node


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
    FX's eliminate_dead_code is wrong on Dynamo's unfunctionalized graph, where it drops in-place
    method calls whose result is unused (`out.copy_(x)`, `y.mul_(3)`; tested in tests/passes)."""
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


def rewrite_each(
    gm: torch.fx.GraphModule, anchors: Iterable[Node], match: Callable[[Node], object], rewrite: Callable
) -> tuple[int, int]:
    """(matched, rewritten) over `anchors`: match(node) is None for no match, rewrite(gm, m) False
    for a declined one. Anchors an earlier rewrite erased are skipped."""
    matched = rewritten = 0
    for node in list(anchors):
        if node.graph is None:
            continue
        m = match(node)
        if m is None:
            continue
        matched += 1
        rewritten += bool(rewrite(gm, m))
    return matched, rewritten
