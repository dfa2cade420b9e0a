"""Per-head q/k RMSNorm folded into the RoPE + KV-write op (Qwen3): two kernels less per layer.

Pattern:      q_r, k_r = atomc.rope_and_write_kv(pos, atomc.rms_norm(q, wq, eps), atomc.rms_norm(k, wk, eps),
                                                 v, cos_sin, layer)
Replacement:  q_r, k_r = atomc.qk_norm_rope_and_write_kv(pos, q, k, v, wq, eps_q, wk, eps_k, cos_sin, layer)
The norms must read only into the rope (no other user); each keeps its own eps (a traced graph may
carry them as two graph values). Models without q/k norms (Llama) match nothing.
"""

from __future__ import annotations

import torch

from atomc.passes import match
from atomc.passes.base import FusionPass
from atomc.passes.rewrite import call, erase_dead

ROPE_KV = torch.ops.atomc.rope_and_write_kv.default
RMS_NORM = torch.ops.atomc.rms_norm.default
FUSED = torch.ops.atomc.qk_norm_rope_and_write_kv.default


def _norm(node):
    """(input, weight, eps) of an atomc.rms_norm read only by one node and keeping its input's dtype
    (the fused op writes q and k in place), else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target is not RMS_NORM:
        return None
    x, weight, eps = node.args
    if len(node.users) != 1 or match.dtype(node) != match.dtype(x):
        return None
    return x, weight, eps


class FuseQKNormRope(FusionPass):
    name = "fuse_qk_norm_rope"
    anchor = ROPE_KV

    def rewrite(self, gm, rope) -> bool:
        positions, q, k, v, cos_sin, layer_idx = rope.args
        qn, kn = _norm(q), _norm(k)
        if qn is None or kn is None or match.ndim(q) != 3 or match.ndim(k) != 3:
            return False
        with gm.graph.inserting_before(rope):
            args = (positions, qn[0], kn[0], v, qn[1], qn[2], kn[1], kn[2], cos_sin, layer_idx)
            fused = call(gm.graph, FUSED, args, rope.meta.get("example_value"))
        rope.replace_all_uses_with(fused)
        erase_dead(gm.graph, [q, k, rope])
        return True
