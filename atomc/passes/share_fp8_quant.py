"""The FP8 quant of an activation that several linears read, done once.

Pattern:      q1, s1 = atomc.fp8_quant_dynamic(x, g);  q2, s2 = atomc.fp8_quant_dynamic(x, g)   (same x, g)
              q1 = atomc.fp8_quant_static(x, s);       q2 = atomc.fp8_quant_static(x, s)        (same x, scale)
Replacement:  the first quant, read by every GEMM that read any of them
Where several linears read one input and each quantises it (q/k/v or gate/up kept apart, DeepSeek's
q_a_proj and kv_a_proj_with_mqa on the same normed hidden state): one quant kernel, one e4m3 copy.
It runs before the norm/SiLU quant fusions, so they see one quant per activation. atomc's loader
merges q/k/v and gate/up into one GEMM each, so on a Llama there is nothing to share. Static quants
of one input with different scales (calibrated apart) stay apart: merging them would change numbers.
"""

from __future__ import annotations

from atomc.passes.base import AtomcPass, PassResult
from atomc.passes.fp8_match import getitem_users, quant_args, quant_kind
from atomc.passes.rewrite import erase_dead


class ShareFP8Quant(AtomcPass):
    name = "share_fp8_quant"

    def source_files(self):
        # the FP8 matchers it shares with the other FP8 passes decide what it matches too
        here = super().source_files()[0]
        return [here, *(here.with_name(name) for name in ("fp8_match.py",))]

    def __call__(self, gm) -> PassResult:
        first: dict[tuple, object] = {}
        matched = rewritten = 0
        for node in list(gm.graph.nodes):
            kind = quant_kind(node)
            if kind is None:
                continue
            key = (kind, *quant_args(node))
            kept = first.setdefault(key, node)
            if kept is node:
                continue
            matched += 1
            if kind == "dynamic" and (getitem_users(node) is None or getitem_users(kept) is None):
                continue  # something reads the tuple itself: leave it
            if kind == "dynamic":
                outputs = getitem_users(kept)
                for index, items in getitem_users(node).items():
                    for item in items:
                        if index in outputs:  # read the kept node's own getitem
                            item.replace_all_uses_with(outputs[index][0])
                        else:
                            item.args = (kept, index)
                            outputs[index] = [item]
                erase_dead(gm.graph, [*(i for items in getitem_users(node).values() for i in items), node])
            else:
                node.replace_all_uses_with(kept)
                erase_dead(gm.graph, [node])
            rewritten += 1
        return PassResult(matched, rewritten)
