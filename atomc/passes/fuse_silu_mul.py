"""SwiGLU on the merged gate_up GEMM -> atomc::silu_and_mul (reads the GEMM output once, no split).

Pattern:      gate, up = y.split([I, I], -1)   (or y.chunk(2, -1));   out = atomc.silu_mul(gate, up)
Replacement:  out = atomc.silu_and_mul(y)
With separate gate and up GEMMs there is no split to fold: silu_mul stays (atomc's loader merges them).
"""

from __future__ import annotations

import torch

from atomc.passes import match
from atomc.passes.base import FusionPass
from atomc.passes.rewrite import call, erase_dead

SILU_MUL = torch.ops.atomc.silu_mul.default
SILU_AND_MUL = torch.ops.atomc.silu_and_mul.default


def _halves_of(gate, up):
    """The tensor y whose last-dim halves are gate and up, with the split node, or None."""
    if not (match.is_op(gate, "getitem") and match.is_op(up, "getitem")):
        return None
    split = gate.args[0]
    if up.args[0] is not split or (gate.args[1], up.args[1]) != (0, 1):
        return None
    y = split.args[0]
    if match.is_op(split, "chunk"):
        ok = match.arg(split, 1, "chunks") == 2
        dim = match.arg(split, 2, "dim", 0)
    elif match.is_op(split, "split"):
        sizes = match.arg(split, 1, "split_size_or_sections", match.arg(split, 1, "split_size"))
        dim = match.arg(split, 2, "dim", 0)
        # two equal halves: [I, I] sections, or split_size I with exactly two outputs
        ok = isinstance(sizes, (list, tuple)) and len(sizes) == 2 and sizes[0] == sizes[1]
        ok = ok or (isinstance(sizes, int) and match.same_shape(gate, up) and len(split.users) == 2)
    else:
        return None
    return (y, split) if ok and match.is_last_dim(dim, y) and match.same_shape(gate, up) else None


class FuseSiluMul(FusionPass):
    name = "fuse_silu_mul"
    anchor = SILU_MUL

    def rewrite(self, gm, node) -> bool:
        found = _halves_of(*node.args)
        if found is None:
            return False
        y, split = found
        with gm.graph.inserting_before(node):
            new = call(gm.graph, SILU_AND_MUL, (y,), match.val(node))
        node.replace_all_uses_with(new)
        erase_dead(gm.graph, [split, *node.args, node])
        return True
