"""RMSNorm -> FP8 quant fused: the norm writes its output in e4m3 with its scale.

Pattern:      n = atomc.rms_norm(x, w, eps);                    q, s = atomc.fp8_quant_dynamic(n, g)
              n, r = atomc.fused_add_rms_norm(x, res, w, eps);  q, s = atomc.fp8_quant_dynamic(n, g)
              (or q = atomc.fp8_quant_static(n, scale))
Replacement:  q, s = atomc.rms_norm_fp8_quant_dynamic(x, w, eps, g)
              q, s, r = atomc.fused_add_rms_norm_fp8_quant_dynamic(x, res, w, eps, g)
              (q = atomc.rms_norm_fp8_quant_static(x, w, eps, scale), q, r = ..._static(...))
The norm's bf16 output is then never written nor read back: each FP8 linear after a norm (qkv after
input_layernorm, gate_up after post_attention_layernorm) saves a kernel and a round trip of the
hidden state. Declined when the norm output has any other reader (a bf16 linear, a router: it must
still exist in bf16), when the quant has one scale for the whole tensor (`g` 0: a per-row kernel
cannot know the tensor's amax), or when `g` does not divide the row. Runs after fuse_add_rmsnorm and
share_fp8_quant (one quant per norm output).
"""

from __future__ import annotations

import torch

from atomc.passes import match
from atomc.passes.base import FusionPass
from atomc.passes.fp8_match import (
    QUANTS,
    example_values,
    fusable_quant,
    getitem_users,
    quant_args,
    replace_quant_outputs,
)
from atomc.passes.rewrite import call, erase_dead, getitems

RMS_NORM = (torch.ops.atomc.rms_norm.default, torch.ops.atomc.rms_norm)
FUSED_ADD = (torch.ops.atomc.fused_add_rms_norm.default, torch.ops.atomc.fused_add_rms_norm)
OPS = {
    ("plain", "dynamic"): torch.ops.atomc.rms_norm_fp8_quant_dynamic.default,
    ("plain", "static"): torch.ops.atomc.rms_norm_fp8_quant_static.default,
    ("add", "dynamic"): torch.ops.atomc.fused_add_rms_norm_fp8_quant_dynamic.default,
    ("add", "static"): torch.ops.atomc.fused_add_rms_norm_fp8_quant_static.default,
}


def norm_source(x):
    """("plain", norm) when x is an rms_norm's output, ("add", fused) when it is a fused add+norm's
    normed output (getitem 0), else None."""
    if not isinstance(x, torch.fx.Node) or x.op != "call_function":
        return None
    if x.target in RMS_NORM:
        return "plain", x
    if match.is_op(x, "getitem") and x.args[1] == 0:
        src = x.args[0]
        if isinstance(src, torch.fx.Node) and src.op == "call_function" and src.target in FUSED_ADD:
            return "add", src
    return None


class FuseRMSNormFP8Quant(FusionPass):
    name = "fuse_rmsnorm_fp8_quant"
    anchor = QUANTS

    def source_files(self):
        # the FP8 matchers it shares with the other FP8 passes decide what it matches too
        here = super().source_files()[0]
        return [here, here.with_name("fp8_match.py")]

    def match(self, quant):
        x = quant_args(quant)[0]
        src = norm_source(x)
        return (quant, x, *src) if src is not None else None

    def rewrite(self, gm, m) -> bool:
        quant, normed, form, norm = m
        fusable = fusable_quant(quant, normed)
        if fusable is None:
            return False
        kind, arg = fusable
        if form == "add" and getitem_users(norm) is None:
            return False
        qvals = example_values(quant)  # (q, s) or (q,)
        nvals = example_values(norm)
        # at the norm's place: a reader of its residual output may come before the quant
        with gm.graph.inserting_before(norm):
            if form == "plain":
                x, w, eps = norm.args[:3]
                vals = qvals
                new = call(gm.graph, OPS[(form, kind)], (x, w, eps, arg), vals if kind == "dynamic" else vals[0])
            else:
                x, res, w, eps = norm.args[:4]
                vals = (*qvals, nvals[1])  # (q, [s,] summed)
                new = call(gm.graph, OPS[(form, kind)], (x, res, w, eps, arg), vals)
            outs = getitems(gm.graph, new, vals) if len(vals) > 1 else [new]
        new_q = outs[0]
        new_s = outs[1] if kind == "dynamic" else None
        replace_quant_outputs(quant, kind, new_q, new_s)
        if form == "add":
            for item in getitem_users(norm).get(1, []):
                item.replace_all_uses_with(outs[-1])  # the residual stream continues from the fused op
        dead = [*(i for items in (getitem_users(quant) or {}).values() for i in items), quant]
        if form == "add":
            dead += [*(i for items in getitem_users(norm).values() for i in items), norm]
        else:
            dead += [normed]
        erase_dead(gm.graph, dead)
        return True
