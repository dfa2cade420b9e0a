"""RoPE + KV-cache write in one kernel: split atomc::attention (write + attend) into
atomc::rope_and_write_kv (rotate q/k, write rotated k and v to the cache) + atomc::paged_attention
(read-only attention), so the RoPE output goes straight into the cache.

Pattern:      q_r, k_r = atomc.rope(pos, q, k, cos_sin);  atomc.attention(q_r, k_r, v, out, layer, scale, window)
Replacement:  q_r, k_r = atomc.rope_and_write_kv(pos, q, k, v, cos_sin, layer)
              atomc.paged_attention(q_r, k_r, v, out, layer, scale, window)
The sliding window (0 when the call leaves it at its default) and the attention sinks (GPT-OSS;
passed on only when the call has them, so a dense graph keeps its exact arguments) go to the
attention that reads.
"""

from __future__ import annotations

import torch

from atomc.passes import match
from atomc.passes.base import FusionPass
from atomc.passes.rewrite import call, erase_dead, getitems

ROPE = torch.ops.atomc.rope.default
ATTENTION = (torch.ops.atomc.attention, torch.ops.atomc.attention.default)
ROPE_KV = torch.ops.atomc.rope_and_write_kv.default
PAGED = torch.ops.atomc.paged_attention.default


def _rope_outputs(q, k):
    """The atomc.rope node whose outputs 0 and 1 are q and k (and nothing else reads it), or None."""
    if not (match.is_op(q, "getitem") and match.is_op(k, "getitem")):
        return None
    rope = q.args[0]
    if k.args[0] is not rope or rope.op != "call_function" or rope.target is not ROPE:
        return None
    if (q.args[1], k.args[1]) != (0, 1) or len(rope.users) != 2:
        return None
    return rope


class FuseRopeKVWrite(FusionPass):
    name = "fuse_rope_kv_write"
    anchor = ATTENTION

    def rewrite(self, gm, attn) -> bool:
        q, k, v, out, layer_idx, scale, window, sinks = _attention_args(attn)
        rope = _rope_outputs(q, k)
        # other users of q/k (e.g. empty_like(q) for `out`) take the fused op's outputs: same values
        if rope is None:
            return False
        positions, q_in, k_in, cos_sin = rope.args
        if not _defined_before(v, rope):
            return False
        with gm.graph.inserting_before(rope):
            vals = rope.meta.get("example_value", (None, None))
            fused = call(gm.graph, ROPE_KV, (positions, q_in, k_in, v, cos_sin, layer_idx), vals)
            q_new, k_new = getitems(gm.graph, fused, vals)
        with gm.graph.inserting_before(attn):
            # paged_attention reads the cache rope_and_write_kv wrote: taking its outputs orders the two
            args = (q_new, k_new, v, out, layer_idx, scale, window) + (() if sinks is None else (sinks,))
            paged = call(gm.graph, PAGED, args)
        attn.replace_all_uses_with(paged)
        q.replace_all_uses_with(q_new)
        k.replace_all_uses_with(k_new)
        erase_dead(gm.graph, [attn, q, k, rope])
        return True


def _attention_args(attn):
    """(q, k, v, out, layer_idx, scale, sliding_window, sinks), positional or keyword; the window
    defaults to 0, the sinks to None."""
    names = ("q", "k", "v", "out", "layer_idx", "scale", "sliding_window", "sinks")
    defaults = {"sliding_window": 0}
    return tuple(
        attn.args[i] if i < len(attn.args) else attn.kwargs.get(n, defaults.get(n)) for i, n in enumerate(names)
    )


def _defined_before(v, node) -> bool:
    """v is computed before `node` (the fused op takes v where the rope was)."""
    if not isinstance(v, torch.fx.Node):
        return False
    for n in node.graph.nodes:
        if n is v:
            return True
        if n is node:
            return False
    return False
