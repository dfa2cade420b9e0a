import torch
from pass_helpers import apply, arch, assert_same, attention, capture, ops, randomize, run
from test_fuse_rope_kv_write import assert_same_over_prefill_and_decode

from atomc.passes.canonicalize import Canonicalize
from atomc.passes.fuse_qk_norm_rope import FuseQKNormRope
from atomc.passes.fuse_rope_attention import FuseRopeAttention
from atomc.passes.fuse_rope_kv_write import FuseRopeKVWrite
from atomc.passes.noop_elimination import NoopElimination
from models.layers.attention import LlamaStyleAttention
from models.layers.rotary import RotaryEmbedding


def graphs(**kw):
    sinks = kw.pop("sinks", False)
    a = arch(**kw)
    torch.manual_seed(0)
    attn, rope = attention(a), RotaryEmbedding(a.head_dim, 64, 10000.0, None)
    if sinks:  # GPT-OSS's per-head sink logits
        attn = randomize(LlamaStyleAttention(a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, 0, sinks=True,
                                             sliding_window=a.sliding_window))  # fmt: skip
    if kw.get("qk_norm"):  # weights away from 1, so a dropped norm weight shows in the numbers
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.data = 1 + 0.5 * torch.randn_like(norm.weight)
    gm, inputs = capture(lambda p, x: attn(p, x, rope), torch.arange(5), torch.randn(5, a.hidden_size))
    for p in (NoopElimination(), Canonicalize(), FuseRopeKVWrite(), FuseQKNormRope()):
        _, gm = apply(p, gm)
    result, after = apply(FuseRopeAttention(), gm)
    return a, gm, inputs, result, after


def fused_args(gm) -> list[tuple]:
    return [n.args for n in gm.graph.nodes if n.target is torch.ops.atomc.rope_paged_attention.default]


def test_rope_write_and_attention_become_one_op():
    a, before, inputs, result, after = graphs()
    assert ops(before)["atomc.rope_and_write_kv"] == 1 and ops(before)["atomc.paged_attention"] == 1
    assert (result.matched, result.rewritten) == (1, 1)
    counts = ops(after)
    assert counts["atomc.rope_paged_attention"] == 1
    assert counts["atomc.rope_and_write_kv"] == 0 and counts["atomc.paged_attention"] == 0
    (args,) = fused_args(after)
    assert args[5] is None and args[7] is None  # no q/k norm weights
    assert_same(run(before, inputs), run(after, inputs))  # no cache: one causal sequence
    assert_same_over_prefill_and_decode(before, after, inputs, a)


def test_the_qk_norms_come_along():
    a, before, inputs, result, after = graphs(qk_norm=True)
    assert ops(before)["atomc.qk_norm_rope_and_write_kv"] == 1
    assert result.rewritten == 1 and ops(after)["atomc.qk_norm_rope_and_write_kv"] == 0
    (args,) = fused_args(after)
    assert args[5] is not None and args[7] is not None
    assert_same(run(before, inputs), run(after, inputs))
    assert_same_over_prefill_and_decode(before, after, inputs, a)


def test_window_and_sinks_are_kept():
    a, before, inputs, result, after = graphs(sliding_window=3, sinks=True)
    assert result.rewritten == 1
    (args,) = fused_args(after)
    assert args[12] == 3 and len(args) == 14  # the window, then the sinks
    assert_same_over_prefill_and_decode(before, after, inputs, a)


def test_out_no_longer_waits_for_the_rotation():
    # the model's `out = empty_like(q_rot)` now reads the unrotated q, so no node of the rotation is left
    _, _, _, _, after = graphs()
    likes = [n for n in after.graph.nodes if n.target in (torch.empty_like, "empty_like")]
    assert likes and all(n.args[0].target is not torch.ops.atomc.rope_and_write_kv.default for n in likes)


def test_a_rotated_q_read_elsewhere_is_left_alone():
    a, before, inputs, _, _ = graphs()
    g = before.graph
    (rope,) = [n for n in g.nodes if n.target is torch.ops.atomc.rope_and_write_kv.default]
    q_rot = next(u for u in rope.users if u.args[1] == 0)
    (output,) = [n for n in g.nodes if n.op == "output"]
    with g.inserting_before(output):
        extra = g.call_function(torch.mul, (q_rot, 2.0))
    output.args = ((*output.args[0], extra) if isinstance(output.args[0], tuple) else (output.args[0], extra),)
    before.recompile()
    result, after = apply(FuseRopeAttention(), before)
    assert (result.matched, result.rewritten) == (1, 0)
    assert ops(after)["atomc.rope_paged_attention"] == 0
