"""RoPE + KV write + paged attention as one op, so a decode step can run them in one kernel.

Pattern:      q_r, k_r = atomc.rope_and_write_kv(pos, q, k, v, cos_sin, layer)
                         (or atomc.qk_norm_rope_and_write_kv(pos, q, k, v, wq, eps_q, wk, eps_k, cos_sin, layer))
              out = empty_like(q_r)
              atomc.paged_attention(q_r, k_r, v, out, layer, scale, window[, sinks])
Replacement:  out = empty_like(q)
              atomc.rope_paged_attention(pos, q, k, v, cos_sin, wq | None, eps_q, wk | None, eps_k,
                                         out, layer, scale, window[, sinks])
The rotated q and k may be read only by the attention and by `empty_like` (the model's `out`, which
takes q's shape and dtype from the unrotated q just as well); the attention must read the v the
write wrote. The backends decide per step what runs: the Triton decode kernel rotates and writes
inside the attention (paged_attention.ROPE_IN_DECODE_ATTENTION), every other case runs the two ops'
kernels in turn, as the graph did before this pass.
"""

from __future__ import annotations

import torch

from atomc.passes import match
from atomc.passes.base import FusionPass
from atomc.passes.rewrite import call, erase_dead

ROPE_KV = torch.ops.atomc.rope_and_write_kv.default
QK_NORM_ROPE_KV = torch.ops.atomc.qk_norm_rope_and_write_kv.default
PAGED = torch.ops.atomc.paged_attention.default
FUSED = torch.ops.atomc.rope_paged_attention.default


def _shape_only(node: torch.fx.Node) -> bool:
    """A call that reads only its first argument's shape, dtype and device (the model's out buffer)."""
    return match.is_op(node, "empty_like")


def _rotation(q, k):
    """The RoPE + KV-write node whose outputs 0 and 1 are q and k (read by nothing else but
    `empty_like`, and the attention), or None."""
    if not (match.is_op(q, "getitem") and match.is_op(k, "getitem")):
        return None
    rope = q.args[0]
    if k.args[0] is not rope or rope.op != "call_function" or rope.target not in (ROPE_KV, QK_NORM_ROPE_KV):
        return None
    if (q.args[1], k.args[1]) != (0, 1) or len(rope.users) != 2 or len(k.users) != 1:
        return None
    if not all(_shape_only(u) for u in q.users if u.target is not PAGED) or len(q.users) > 2:
        return None
    return rope


def _rotation_args(rope):
    """(positions, q, k, v, cos_sin, q_weight, q_eps, k_weight, k_eps, layer_idx) of either op."""
    if rope.target is ROPE_KV:
        positions, q, k, v, cos_sin, layer_idx = rope.args
        return positions, q, k, v, cos_sin, None, 0.0, None, 0.0, layer_idx
    positions, q, k, v, qw, q_eps, kw, k_eps, cos_sin, layer_idx = rope.args
    return positions, q, k, v, cos_sin, qw, q_eps, kw, k_eps, layer_idx


class FuseRopeAttention(FusionPass):
    name = "fuse_rope_attention"
    anchor = PAGED

    def rewrite(self, gm, attn) -> bool:
        q, k, v, out, layer_idx, scale, window, sinks = _paged_args(attn)
        rope = _rotation(q, k)
        if rope is None:
            return False
        positions, q_in, k_in, rope_v, cos_sin, qw, q_eps, kw, k_eps, rope_layer = _rotation_args(rope)
        if rope_v is not v or rope_layer != layer_idx:
            return False
        for user in [u for u in q.users if u is not attn]:
            user.replace_input_with(q, q_in)  # empty_like(q_rot) -> empty_like(q): the same buffer
        with gm.graph.inserting_before(attn):
            args = (positions, q_in, k_in, v, cos_sin, qw, q_eps, kw, k_eps, out, layer_idx, scale, window)
            fused = call(gm.graph, FUSED, args + (() if sinks is None else (sinks,)))
        attn.replace_all_uses_with(fused)
        erase_dead(gm.graph, [attn, q, k, rope])
        return True


def _paged_args(attn):
    """(q, k, v, out, layer_idx, scale, sliding_window, sinks) of a paged_attention call, positional
    or keyword; the window defaults to 0, the sinks to None."""
    names = ("q", "k", "v", "out", "layer_idx", "scale", "sliding_window", "sinks")
    defaults = {"sliding_window": 0}
    return tuple(
        attn.args[i] if i < len(attn.args) else attn.kwargs.get(n, defaults.get(n)) for i, n in enumerate(names)
    )
