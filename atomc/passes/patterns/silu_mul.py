"""SiLU * mul (SwiGLU) -> atomc::silu_mul.

Pattern:      out = F.silu(gate) * up
Replacement:  out = atomc.silu_mul(gate, up)
"""

from __future__ import annotations

import torch
from torch.fx import Node

from atomc.passes import match
from atomc.passes.patterns.base import NodePattern
from atomc.passes.rewrite import call, erase_dead


class SiluMulPattern(NodePattern):
    name = "silu_mul"

    def match(self, node: Node):
        if not match.is_op(node, "mul"):
            return None
        for s, up in match.commuted(node):
            if not match.is_op(s, "silu") or not isinstance(up, Node):
                continue
            if s.kwargs.get("inplace") or (len(s.args) > 1 and s.args[1]):
                continue
            gate = s.args[0]
            if match.val(gate) is not None and not match.same_shape(gate, up):
                continue  # broadcasting multiply: not the elementwise op
            return node, s, gate, up
        return None

    def replace(self, gm, m) -> bool:
        node, s, gate, up = m
        if set(s.users) != {node}:
            return False
        with gm.graph.inserting_before(node):
            new = call(gm.graph, torch.ops.atomc.silu_mul.default, (gate, up), match.val(node))
        node.replace_all_uses_with(new)
        erase_dead(gm.graph, [s, node])
        return True
