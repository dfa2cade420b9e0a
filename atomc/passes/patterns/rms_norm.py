"""RMSNorm -> atomc::rms_norm.

Pattern (models.layers.norm.RMSNorm; the casts are gone after noop_elimination in fp32 models):
    xf = x.float();  y = xf * rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps);  out = w * y.to(x.dtype)
Replacement:
    out = atomc.rms_norm(x, w, eps)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from atomc.passes import match
from atomc.passes.patterns.base import NodePattern
from atomc.passes.rewrite import call, erase_dead, single_use


@dataclass
class RMSNormMatch:
    anchor: Node  # w * y
    x: Node  # input before the fp32 cast
    weight: Node
    eps: object  # float, or a node (Dynamo may lift module floats to graph inputs)
    inner: list  # the pattern's intermediate nodes, removed after the rewrite


def _cast_of(node, to: torch.dtype | None = None):
    """If node is x.float() / x.to(dtype), return (x, dtype); else None."""
    if not isinstance(node, Node) or node.op != "call_method":
        return None
    if node.target == "float" and len(node.args) == 1 and not node.kwargs:
        return node.args[0], torch.float32
    if node.target == "to" and len(node.args) == 2 and not node.kwargs:
        return (node.args[0], node.args[1]) if isinstance(node.args[1], torch.dtype) else None
    return None


def _normalised(y: Node):
    """y = xf * rsqrt(mean(xf ** 2, -1, keepdim) + eps) -> (xf, eps, [intermediates]) or None."""
    if not match.is_op(y, "mul"):
        return None
    for xf, r in match.commuted(y):
        if not match.is_op(r, "rsqrt"):
            continue
        add = r.args[0]
        if not match.is_op(add, "add"):
            continue
        for mean, eps in match.commuted(add):
            if not match.is_op(mean, "mean"):
                continue
            dim = match.arg(mean, 1, "dim")
            dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
            if not (match.arg(mean, 2, "keepdim", False) and match.is_last_dim(dim, xf)):
                continue
            sq = mean.args[0]
            if not (match.is_op(sq, "pow") and sq.args[0] is xf and sq.args[1] in (2, 2.0)):
                continue
            if isinstance(eps, Node) and match.val(eps) is not None:
                continue  # a tensor, not a scalar epsilon
            return xf, eps, [r, add, mean, sq]
    return None


class RMSNormPattern(NodePattern):
    name = "rms_norm"

    def match(self, node: Node):
        if not match.is_op(node, "mul"):
            return None
        for weight, y in match.commuted(node):
            if match.ndim(weight) != 1:
                continue
            out_cast = _cast_of(y)
            core = out_cast[0] if out_cast else y
            found = _normalised(core)
            if found is None:
                continue
            xf, eps, inner = found
            in_cast = _cast_of(xf)
            x = in_cast[0] if in_cast else xf
            if in_cast and in_cast[1] != torch.float32:
                continue
            if in_cast or out_cast:
                # both casts, back to the input dtype: the fp32-statistics form the op computes
                if not (in_cast and out_cast and out_cast[1] == match.dtype(x)):
                    continue
            elif match.dtype(x) not in (torch.float32, None):
                continue  # statistics in low precision: not what the op computes
            nodes = [core, *inner] + ([y] if out_cast else []) + ([xf] if in_cast else [])
            return RMSNormMatch(node, x, weight, eps, nodes)
        return None

    def replace(self, gm, m: RMSNormMatch) -> bool:
        # the intermediates must die with the pattern, or the norm would be computed twice
        removable = [n for n in m.inner if n is not m.x]
        if not single_use(removable, [m.anchor, *removable]):
            return False
        with gm.graph.inserting_before(m.anchor):
            args = (m.x, m.weight, m.eps)
            new = call(gm.graph, torch.ops.atomc.rms_norm.default, args, match.val(m.anchor))
        m.anchor.replace_all_uses_with(new)
        erase_dead(gm.graph, [*removable, m.anchor])
        return True
