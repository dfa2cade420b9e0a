"""Residual add + RMSNorm -> atomc::fused_add_rms_norm (one pass over the row instead of three).

Pattern:      s = a + b;  n = atomc.rms_norm(s, w, eps)          (s may have other users)
Replacement:  n, s = atomc.fused_add_rms_norm(a, b, w, eps)
"""

from __future__ import annotations

import torch

from atomc.passes import match
from atomc.passes.base import FusionPass
from atomc.passes.rewrite import call, erase_dead, getitems

RMS_NORM = torch.ops.atomc.rms_norm.default
FUSED = torch.ops.atomc.fused_add_rms_norm.default


def _fusable_add(node) -> bool:
    if not match.is_op(node, "add") or node.kwargs or len(node.args) != 2:
        return False  # add(a, b, alpha=...) is not a plain residual add
    a, b = node.args
    # same shape and dtype: a residual stream, not a broadcast bias or a scalar
    return match.same_shape(a, b) and match.same_shape(a, node) and match.dtype(a) == match.dtype(b)


class FuseAddRMSNorm(FusionPass):
    name = "fuse_add_rmsnorm"
    anchor = RMS_NORM

    def match(self, norm):
        return norm if _fusable_add(norm.args[0]) else None  # a norm without an add is no match

    def rewrite(self, gm, norm) -> bool:
        s = norm.args[0]
        a, b = s.args
        x, weight, eps = norm.args
        with gm.graph.inserting_before(norm):
            vals = (match.val(norm), match.val(s))
            fused = call(gm.graph, FUSED, (a, b, weight, eps), vals)
            normed, summed = getitems(gm.graph, fused, vals)
        norm.replace_all_uses_with(normed)
        s.replace_all_uses_with(summed)  # the residual stream continues from the fused op
        erase_dead(gm.graph, [norm, s])
        return True
