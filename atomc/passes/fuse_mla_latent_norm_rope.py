"""The MLA latent's RMSNorm and the RoPE of its rope parts in one op (DeepSeek-V2/V3): one kernel for
what was a norm, a RoPE and, on interleaved checkpoints, four gathers and two concatenations.

Pattern:      c = atomc.rms_norm(c_kv, w, eps)
              q_r, k_r = atomc.rope(pos, gather(q_pe), gather(k_pe), cos_sin)
              atomc.mla_attention(q_abs, q_r, c, k_r.view(T, R), out, layer, scale)
              (gather(x) = cat([x[..., 0::2], x[..., 1::2]], -1), the de-interleave of V2 and of V3's
              `rope_interleave`; without it the rope reads q_pe and k_pe as they are)
Replacement:  q_r, k_r, c = atomc.mla_latent_norm_rope(pos, q_pe, k_pe, c_kv, w, eps, cos_sin, interleaved)
              atomc.mla_attention(q_abs, q_r, c, k_r.view(T, R), out, layer, scale)
The anchor is the attention: the norm and the rope it fuses are the ones that produce that layer's
latent and rope parts (the model emits mla_attention itself; only these small steps are matched).
Declined: a norm read by anything but the attention (it would be computed twice), q/k not the
rope's two outputs, shapes other than q_pe [T, H, R], k_pe [T, 1, R], c_kv [T, L], weight [L] with
one T, q_pe and k_pe of two dtypes. The gathers fold in only when both q_pe and k_pe have them;
otherwise the op reads the gathered tensors (its one flag covers both).
"""

from __future__ import annotations

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from atomc.passes import match
from atomc.passes.base import FusionPass
from atomc.passes.rewrite import call, erase_dead, getitems

MLA = (torch.ops.atomc.mla_attention, torch.ops.atomc.mla_attention.default)
# canonicalize emits the overloads; a model calling the ops itself leaves the packets
RMS_NORM = (torch.ops.atomc.rms_norm, torch.ops.atomc.rms_norm.default)
ROPE = (torch.ops.atomc.rope, torch.ops.atomc.rope.default)
FUSED = torch.ops.atomc.mla_latent_norm_rope.default


def _rope_output(node, index: int):
    """The atomc.rope node whose output `index` is `node` (a getitem), or None."""
    if not match.is_op(node, "getitem") or node.args[1] != index:
        return None
    rope = node.args[0]
    return rope if isinstance(rope, Node) and rope.op == "call_function" and rope.target in ROPE else None


def _view_source(node):
    """x for x.view(...) / x.reshape(...), else node itself."""
    if isinstance(node, Node) and node.op == "call_method" and node.target in ("view", "reshape"):
        return node.args[0]
    return node


def _stride_two(index, start: int, ndim: int | None) -> bool:
    """index is x[..., start::2] of the last dim (also spelled with full slices before it)."""
    if not isinstance(index, tuple) or not index:
        return False
    *lead, last = index
    if not (isinstance(last, slice) and last.step == 2 and last.stop is None and (last.start or 0) == start):
        return False
    if not all(i is Ellipsis or i == slice(None) for i in lead):
        return False
    return Ellipsis in lead or len(index) == ndim  # x[:, 0::2] of a 3-D x slices the heads


def _gathered(node):
    """(x, [gather nodes]) when node = cat([x[..., 0::2], x[..., 1::2]], -1), else None."""
    if not match.is_op(node, "cat") or not match.is_last_dim(match.arg(node, 1, "dim", 0), node):
        return None
    parts = match.arg(node, 0, "tensors")
    if not (isinstance(parts, (list, tuple)) and len(parts) == 2):
        return None
    evens, odds = parts
    if not (match.is_op(evens, "getitem") and match.is_op(odds, "getitem") and evens.args[0] is odds.args[0]):
        return None
    x = evens.args[0]
    if not (_stride_two(evens.args[1], 0, match.ndim(x)) and _stride_two(odds.args[1], 1, match.ndim(x))):
        return None
    return x, [node, evens, odds]


def _size(node, dim: int):
    return match.val(node).shape[dim]


def _same(a, b) -> bool:
    return statically_known_true(a == b)


def _shapes_fit(q_pe, k_pe, c_kv, weight) -> bool:
    """q_pe [T, H, R], k_pe [T, 1, R], c_kv [T, L], weight [L], R even, one T."""
    if (match.ndim(q_pe), match.ndim(k_pe), match.ndim(c_kv), match.ndim(weight)) != (3, 3, 2, 1):
        return False
    tokens, rope_dim = _size(q_pe, 0), _size(q_pe, 2)
    return (
        _same(_size(k_pe, 0), tokens)
        and _same(_size(c_kv, 0), tokens)
        and _same(_size(k_pe, 1), 1)
        and _same(_size(k_pe, 2), rope_dim)
        and _same(rope_dim % 2, 0)
        and _same(_size(weight, 0), _size(c_kv, 1))
    )


class FuseMLALatentNormRope(FusionPass):
    name = "fuse_mla_latent_norm_rope"
    anchor = MLA

    def rewrite(self, gm, attn) -> bool:
        q_rot, c, k_arg = match.arg(attn, 1, "q_pe"), match.arg(attn, 2, "c_kv"), match.arg(attn, 3, "k_pe")
        k_rot = _view_source(k_arg)
        rope = _rope_output(q_rot, 0)
        if rope is None or _rope_output(k_rot, 1) is not rope or len(rope.users) != 2:
            return False
        if not (isinstance(c, Node) and c.op == "call_function" and c.target in RMS_NORM) or len(c.users) != 1:
            return False
        if len(rope.args) != 4 or len(c.args) != 3 or rope.kwargs or c.kwargs:
            return False  # the spellings canonicalize and the models use: all positional
        positions, q_in, k_in, cos_sin = rope.args
        c_kv, weight, eps = c.args
        gq, gk = _gathered(q_in), _gathered(k_in)
        interleaved = gq is not None and gk is not None
        q_pe, k_pe = (gq[0], gk[0]) if interleaved else (q_in, k_in)
        if not _shapes_fit(q_pe, k_pe, c_kv, weight) or match.dtype(q_pe) != match.dtype(k_pe):
            return False
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        at = max(rope, c, key=order.__getitem__)  # every input of both is defined before it
        users = [u for n in (c, q_rot, k_rot) for u in n.users]
        if any(order[u] <= order[at] for u in users):
            return False  # something reads an output before both halves are computed
        vals = (match.val(q_rot), match.val(k_rot), match.val(c))
        with gm.graph.inserting_before(at):
            fused = call(gm.graph, FUSED, (positions, q_pe, k_pe, c_kv, weight, eps, cos_sin, interleaved), vals)
            q_new, k_new, c_new = getitems(gm.graph, fused, vals)
        q_rot.replace_all_uses_with(q_new)
        k_rot.replace_all_uses_with(k_new)
        c.replace_all_uses_with(c_new)
        erase_dead(gm.graph, [*(gq[1] if gq else []), *(gk[1] if gk else []), c, rope, q_rot, k_rot])
        return True
