"""Neox (rotate-half) RoPE on q and k -> atomc::rope.

Pattern (models.layers.rotary.RotaryEmbedding; `.to` is gone after noop_elimination in fp32 models):
    c, s = cos_sin[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
    cos, sin = cat([c, c], -1), cat([s, s], -1)
    x1, x2 = x.chunk(2, dim=-1);  x_rot = x * cos + cat([-x2, x1], -1) * sin      (for x in q, k)
Replacement:
    q_rot, k_rot = atomc.rope(positions, q, k, cos_sin)
Rotations sharing one table lookup are paired in graph order (q first, as the model writes it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from atomc.passes import match
from atomc.passes.patterns.base import Pattern
from atomc.passes.rewrite import call, erase_dead, getitems


@dataclass
class Table:
    cache: Node
    positions: Node
    cos: Node  # cat([c, c])
    sin: Node
    cast: torch.dtype | None  # the lookup's `.to(dtype)`, if any
    nodes: list  # lookup, cast, unsqueeze, chunk, getitems, cats


@dataclass
class Rotation:
    out: Node  # the final add
    x: Node
    table: Table
    nodes: list


def _halves(node):
    """cat([h, h], -1) with h = chunk(t, 2, -1)[i] -> (chunk, i, h) or None."""
    if not match.is_op(node, "cat"):
        return None
    parts = match.arg(node, 0, "tensors")
    dim = match.arg(node, 1, "dim", 0)
    if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and parts[0] is parts[1]):
        return None
    h = parts[0]
    if not (match.is_op(h, "getitem") and match.is_op(h.args[0], "chunk") and match.is_last_dim(dim, node)):
        return None
    return h.args[0], h.args[1], h


def _split_in_two(chunk: Node) -> bool:
    dim = match.arg(chunk, 2, "dim", 0)
    return match.arg(chunk, 1, "chunks") == 2 and match.is_last_dim(dim, chunk.args[0])


def _table(cos: Node, sin: Node) -> Table | None:
    hc, hs = _halves(cos), _halves(sin)
    if hc is None or hs is None or hc[0] is not hs[0] or (hc[1], hs[1]) != (0, 1):
        return None
    chunk = hc[0]
    if not _split_in_two(chunk):
        return None
    unsq = chunk.args[0]
    if not (match.is_op(unsq, "unsqueeze") and match.arg(unsq, 1, "dim") == 1):
        return None
    src, nodes, cast = unsq.args[0], [cos, sin, hc[2], hs[2], chunk, unsq], None
    if isinstance(src, Node) and src.op == "call_method" and src.target == "to":
        if len(src.args) != 2 or src.kwargs or not isinstance(src.args[1], torch.dtype):
            return None
        nodes.append(src)
        src, cast = src.args[0], src.args[1]
    if not (match.is_op(src, "getitem") and isinstance(src.args[1], Node)):
        return None
    nodes.append(src)
    return Table(src.args[0], src.args[1], cos, sin, cast, nodes)


def _rotation(add: Node) -> Rotation | None:
    if not match.is_op(add, "add"):
        return None
    for a, b in match.commuted(add):
        if not (match.is_op(a, "mul") and match.is_op(b, "mul")):
            continue
        for x, cos in match.commuted(a):
            for rot, sin in match.commuted(b):
                found = _rotate_half_of(rot)
                if found is None or found[0] is not x:
                    continue
                table = _table(cos, sin)
                if table is None:
                    continue
                return Rotation(add, x, table, [a, b, *found[1]])
    return None


def _rotate_half_of(cat: Node):
    """cat([-x2, x1], -1) with x1, x2 = chunk(x, 2, -1) -> (x, [nodes]) or None."""
    if not match.is_op(cat, "cat"):
        return None
    parts = match.arg(cat, 0, "tensors")
    if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and match.is_op(parts[0], "neg")):
        return None
    x2, x1 = parts[0].args[0], parts[1]
    if not (match.is_op(x1, "getitem") and match.is_op(x2, "getitem") and x1.args[0] is x2.args[0]):
        return None
    chunk = x1.args[0]
    if not (match.is_op(chunk, "chunk") and _split_in_two(chunk) and (x1.args[1], x2.args[1]) == (0, 1)):
        return None
    if not match.is_last_dim(match.arg(cat, 1, "dim", 0), cat):
        return None
    return chunk.args[0], [cat, parts[0], x1, x2, chunk]


class RopePattern(Pattern):
    name = "rope"

    def apply(self, gm):
        groups: dict[tuple, list[Rotation]] = {}
        for node in gm.graph.nodes:
            r = _rotation(node)
            if r is not None:
                groups.setdefault((r.table.cos, r.table.sin), []).append(r)
        matched = rewritten = 0
        for rots in groups.values():
            for q, k in zip(rots[0::2], rots[1::2], strict=False):
                matched += 1
                rewritten += self._replace(gm, q, k)
        return matched, rewritten

    def _replace(self, gm, q: Rotation, k: Rotation) -> bool:
        table = q.table
        table_dtype = table.cast or match.dtype(table.cache)
        if None not in (table_dtype, match.dtype(q.x)) and table_dtype != match.dtype(q.x):
            return False  # the op casts the table to q's dtype; this graph computes in another one
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        anchor = min(q.out, k.out, key=order.__getitem__)
        inputs = (table.positions, table.cache, q.x, k.x)
        if any(order[n] > order[anchor] for n in inputs):
            return False  # k is computed after q is rotated: no single place for the fused op
        with gm.graph.inserting_before(anchor):
            vals = (match.val(q.out), match.val(k.out))
            rope = call(gm.graph, torch.ops.atomc.rope.default, (table.positions, q.x, k.x, table.cache))
            rope.meta["example_value"] = vals
            q_new, k_new = getitems(gm.graph, rope, vals)
        q.out.replace_all_uses_with(q_new)
        k.out.replace_all_uses_with(k_new)
        erase_dead(gm.graph, [*table.nodes[::-1], *q.nodes[::-1], *k.nodes[::-1], q.out, k.out])
        return True
