"""Tensor-parallel all-reduce + residual add + RMSNorm -> atomc::all_reduce_add_rms_norm.

Pattern:      p = atomc.all_reduce(x, group);  n, s = atomc.fused_add_rms_norm(p, r, w, eps)
              (p either operand; p read by nothing else)
Replacement:  n, s = atomc.all_reduce_add_rms_norm(x, r, w, eps, group)

At TP > 1 every row-parallel output (attention's o_proj, the MLP's down_proj, a MoE block) is
all-reduced and then added to the residual stream, whose sum the next norm reads: the three ops
become one, so a backend can reduce the ranks' partial sums, add and normalise in one kernel that
never writes the reduced sum alone (atomc/kernels/triton/all_reduce_norm.py). It anchors on the
fused add + norm, so it runs after fuse_add_rmsnorm (with that pass disabled it finds nothing), and
after fuse_rmsnorm_fp8_quant: where a norm feeds an FP8 linear the norm + quant fusion has already
taken the add + norm (`fused_add_rms_norm_fp8_quant_*`), and the all-reduce stays apart there (no
backend fuses all four yet). Declined when the reduced sum has another reader (the vocab-parallel
embedding's all-reduce also feeds the first layer's plain norm): it must still exist on its own.
The pass manager adds it only at tensor-parallel size > 1 (at size 1 the layers emit no all-reduce).
"""

from __future__ import annotations

import torch

from atomc.passes import match
from atomc.passes.base import FusionPass
from atomc.passes.rewrite import call, erase_dead, getitems

ALL_REDUCE = (torch.ops.atomc.all_reduce.default, torch.ops.atomc.all_reduce)
FUSED_ADD = (torch.ops.atomc.fused_add_rms_norm.default, torch.ops.atomc.fused_add_rms_norm)
FUSED = torch.ops.atomc.all_reduce_add_rms_norm.default


def _all_reduce(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in ALL_REDUCE


class FuseAllReduceRMSNorm(FusionPass):
    name = "fuse_allreduce_rmsnorm"
    anchor = FUSED_ADD

    declined = 0  # matches kept apart in the current run (the report's notes)

    def __call__(self, gm):
        self.declined = 0
        return super().__call__(gm)

    def match(self, norm):
        a, b = norm.args[:2]
        if not (_all_reduce(a) or _all_reduce(b)):
            return None  # a residual add of two local tensors: no collective to fuse
        return norm

    def rewrite(self, gm, norm) -> bool:
        a, b, weight, eps = norm.args
        # the operand that is an all-reduce read by this add alone (the other one is the residual)
        exclusive = [(p, q) for p, q in ((a, b), (b, a)) if _all_reduce(p) and set(p.users) == {norm} and not p.kwargs]
        if not exclusive:
            self.declined += 1
            return False
        reduced, residual = exclusive[0]
        x, group = reduced.args
        getters = {u.args[1]: u for u in norm.users if match.is_op(u, "getitem")}
        if len(getters) != len(norm.users):
            return False  # the pair read whole (not through [0], [1]): leave it
        with gm.graph.inserting_before(norm):
            vals = norm.meta.get("example_value") or (None, None)
            fused = call(gm.graph, FUSED, (x, residual, weight, eps, group), vals)
            new = getitems(gm.graph, fused, vals)
        for i, old in getters.items():
            old.replace_all_uses_with(new[i])
        erase_dead(gm.graph, [reduced, norm, *getters.values(), *new])  # `new`: an output nobody reads
        return True

    def notes(self) -> str:
        return f"{self.declined} kept apart (the reduced sum has other readers)" if self.declined else ""
