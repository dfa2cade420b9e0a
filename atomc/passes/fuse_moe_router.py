"""The MoE block's router linear folded into its op, so the decode step routes in one kernel (CUDA).

Pattern:      out = atomc.moe(x, F.linear(x, w_router, b_router), w13, w2, ...)
Replacement:  out = atomc.moe_routed(x, w_router, b_router, w13, w2, ...)
The logits must have no other reader and come from the block's own input. On CUDA the Triton body
computes one token's logits and its softmax top-k in one kernel (moe_routing.py: the router GEMV's
programs draw tickets, the last one routes), a launch fewer per MoE layer at batch-1 decode; for
more tokens, or routings that kernel does not take, it runs the same linear and `atomc::moe`.
Other platforms keep the pair (there is no fused kernel to gain from there).
"""

from __future__ import annotations

import torch

from atomc.passes import match
from atomc.passes.base import FusionPass
from atomc.passes.rewrite import call, erase_dead

MOE = (torch.ops.atomc.moe, torch.ops.atomc.moe.default)
LINEARS = (torch.ops.atomc.linear, torch.ops.atomc.linear.default)
FUSED = torch.ops.atomc.moe_routed.default
PLATFORMS = ("cuda",)


def _router(node, x):
    """(weight, bias) of a linear of `x` read by nothing but the MoE op, else None."""
    if not isinstance(node, torch.fx.Node) or len(node.users) != 1:
        return None
    if not (match.is_op(node, "linear") or (node.op == "call_function" and node.target in LINEARS)):
        return None
    if match.arg(node, 0, "input") is not x:
        return None
    weight, bias = match.arg(node, 1, "weight"), match.arg(node, 2, "bias")
    return (weight, bias) if match.ndim(weight) == 2 else None


class FuseMoERouter(FusionPass):
    name = "fuse_moe_router"
    anchor = MOE

    def __init__(self, platform: str = "cpu"):
        self.platform = platform

    def rewrite(self, gm, moe) -> bool:
        if self.platform not in PLATFORMS or moe.kwargs:
            return False
        x, logits, *rest = moe.args
        router = _router(logits, x)
        if router is None:
            return False
        with gm.graph.inserting_before(moe):
            fused = call(gm.graph, FUSED, (x, *router, *rest), moe.meta.get("example_value"))
        moe.replace_all_uses_with(fused)
        erase_dead(gm.graph, [moe, logits])
        return True

    def notes(self) -> str:
        return "" if self.platform in PLATFORMS else f"router linear kept apart on {self.platform}"
