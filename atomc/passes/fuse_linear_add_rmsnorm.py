"""A linear read only by the residual add + RMSNorm after it becomes one op with that norm.

Pattern:      y = atomc.linear(x, w, b);                          n, r = atomc.fused_add_rms_norm(y, res, nw, eps)
              y = atomc.fp8_linear_dynamic(x, g, w, ws, b, dt, silu)
              q, s, r = atomc.fused_add_rms_norm_fp8_quant_dynamic(y, res, nw, eps, g2)
Replacement:  n, r = atomc.linear_add_rms_norm(x, w, b, res, nw, eps)
              q, s, r = atomc.fp8_linear_add_rms_norm_quant(x, g, w, ws, b, dt, silu, res, nw, eps, g2)
In a decoder layer that is the o projection with the post-attention norm, and a dense MLP's down
projection with the next layer's input norm. At one row the CUDA backend then runs the norm in the
GEMV's last program (atomc/ops/linear_norm.py), a launch fewer a norm. Runs after decode_gemv
(which makes atomc.linear) and the FP8 fusions; declined when y has another reader. CUDA only:
the ops have no AITER binding, and elsewhere no backend runs them as one kernel. At TP > 1 an
all-reduce sits between the two and nothing matches.
"""

from __future__ import annotations

import torch

from atomc.passes import match
from atomc.passes.base import FusionPass
from atomc.passes.rewrite import erase_dead

NORM = torch.ops.atomc.fused_add_rms_norm.default
NORM_QUANT = torch.ops.atomc.fused_add_rms_norm_fp8_quant_dynamic.default
LINEAR = torch.ops.atomc.linear.default
FP8_LINEAR = torch.ops.atomc.fp8_linear_dynamic.default
FUSED = {NORM: torch.ops.atomc.linear_add_rms_norm.default,
         NORM_QUANT: torch.ops.atomc.fp8_linear_add_rms_norm_quant.default}  # fmt: skip
PRODUCER = {NORM: LINEAR, NORM_QUANT: FP8_LINEAR}
LINEAR_ARGS = {
    LINEAR: ("input", "weight", "bias"),
    FP8_LINEAR: ("x", "group_size", "weight", "weight_scale", "bias", "out_dtype", "silu_and_mul"),
}
NORM_ARGS = {NORM: ("x", "residual", "weight", "eps"),
             NORM_QUANT: ("x", "residual", "weight", "eps", "group_size")}  # fmt: skip
PLATFORMS = ("cuda",)


def _overload(target):
    """The `.default` overload for a call written either way (`atomc.op` or `atomc.op.default`)."""
    return target.default if isinstance(target, torch._ops.OpOverloadPacket) else target


class FuseLinearAddRMSNorm(FusionPass):
    name = "fuse_linear_add_rmsnorm"
    anchor = (NORM, NORM_QUANT, NORM.overloadpacket, NORM_QUANT.overloadpacket)

    def __init__(self, platform: str = "cpu"):
        self.platform = platform

    def match(self, norm):
        """(norm, linear, residual): the linear is either addend (the add is exact either way round)."""
        a, b = match.arg(norm, 0, "x"), match.arg(norm, 1, "residual")
        producer = PRODUCER[_overload(norm.target)]
        for y, residual in ((a, b), (b, a)):
            if not isinstance(y, torch.fx.Node) or y.op != "call_function" or _overload(y.target) is not producer:
                continue
            if set(y.users) == {norm} and residual is not y:
                return norm, y, residual
        return None

    def rewrite(self, gm, m) -> bool:
        if self.platform not in PLATFORMS:
            return False
        norm, linear, residual = m
        kind = _overload(norm.target)
        linear_args = tuple(match.arg(linear, i, name) for i, name in enumerate(LINEAR_ARGS[_overload(linear.target)]))
        norm_args = tuple(match.arg(norm, i, name) for i, name in enumerate(NORM_ARGS[kind]))
        # the fused op takes the norm's place (its outputs, their readers and example values stay)
        norm.target, norm.args, norm.kwargs = FUSED[kind], (*linear_args, residual, *norm_args[2:]), {}
        erase_dead(gm.graph, [linear])
        return True

    def notes(self) -> str:
        return "" if self.platform in PLATFORMS else f"linear and norm kept apart on {self.platform}"
