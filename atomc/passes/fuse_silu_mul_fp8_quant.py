"""SiLU·mul -> FP8 quant fused: the MLP's activation is written in e4m3 with its scale.

Pattern:      a = atomc.silu_and_mul(y);  q, s = atomc.fp8_quant_dynamic(a, g)   (or q = fp8_quant_static(a, scale))
Replacement:  q, s = atomc.silu_and_mul_fp8_quant_dynamic(y, g)            (q = ..._static(y, scale))
The activation [T, I] (I = 14,336 on Llama-3.1-8B: the widest activation of the layer) is then
never written in bf16 nor read back before the down projection. Declined when the activation has
another reader, for one dynamic scale over the whole tensor (`g` 0) and for a `g` that does not
divide I. Needs the merged gate_up GEMM (fuse_silu_mul's `silu_and_mul`); runs after it.
"""

from __future__ import annotations

import torch

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

SILU_AND_MUL = (torch.ops.atomc.silu_and_mul.default, torch.ops.atomc.silu_and_mul)
OPS = {
    "dynamic": torch.ops.atomc.silu_and_mul_fp8_quant_dynamic.default,
    "static": torch.ops.atomc.silu_and_mul_fp8_quant_static.default,
}


class FuseSiluMulFP8Quant(FusionPass):
    name = "fuse_silu_mul_fp8_quant"
    anchor = QUANTS

    def source_files(self):
        # the FP8 matchers it shares with the other FP8 passes decide what it matches too
        here = super().source_files()[0]
        return [here, here.with_name("fp8_match.py")]

    def match(self, quant):
        act = quant_args(quant)[0]
        ok = isinstance(act, torch.fx.Node) and act.op == "call_function" and act.target in SILU_AND_MUL
        return (quant, act) if ok else None

    def rewrite(self, gm, m) -> bool:
        quant, act = m
        fusable = fusable_quant(quant, act)
        if fusable is None:
            return False
        kind, arg = fusable
        vals = example_values(quant)
        with gm.graph.inserting_before(act):
            new = call(gm.graph, OPS[kind], (act.args[0], arg), vals if kind == "dynamic" else vals[0])
            outs = getitems(gm.graph, new, vals) if kind == "dynamic" else [new]
        replace_quant_outputs(quant, kind, outs[0], outs[1] if kind == "dynamic" else None)
        erase_dead(gm.graph, [*(i for items in (getitem_users(quant) or {}).values() for i in items), quant, act])
        return True
