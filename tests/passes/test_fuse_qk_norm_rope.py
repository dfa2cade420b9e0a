import torch
from pass_helpers import apply, arch, assert_same, attention, capture, ops, run
from test_fuse_rope_kv_write import assert_same_over_prefill_and_decode

from atomc.passes.canonicalize import Canonicalize
from atomc.passes.fuse_qk_norm_rope import FuseQKNormRope
from atomc.passes.fuse_rope_kv_write import FuseRopeKVWrite
from atomc.passes.noop_elimination import NoopElimination
from models.layers.rotary import RotaryEmbedding


def graphs(qk_norm: bool):
    a = arch(qk_norm=qk_norm)
    torch.manual_seed(0)
    attn, rope = attention(a), RotaryEmbedding(a.head_dim, 64, 10000.0, None)
    if qk_norm:  # weights away from 1, so a dropped norm weight shows in the numbers
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.data = 1 + 0.5 * torch.randn_like(norm.weight)
    gm, inputs = capture(lambda p, x: attn(p, x, rope), torch.arange(5), torch.randn(5, a.hidden_size))
    before = gm
    for p in (NoopElimination(), Canonicalize(), FuseRopeKVWrite()):
        _, gm = apply(p, gm)
    result, after = apply(FuseQKNormRope(), gm)
    return before, inputs, gm, result, after


def test_qk_norms_fold_into_the_rope_kv_write():
    gm, inputs, fused_rope, result, after = graphs(qk_norm=True)
    assert ops(fused_rope)["atomc.rms_norm"] == 2 and ops(fused_rope)["atomc.rope_and_write_kv"] == 1
    assert (result.matched, result.rewritten) == (1, 1)
    counts = ops(after)
    assert counts["atomc.qk_norm_rope_and_write_kv"] == 1
    assert counts["atomc.rms_norm"] == 0 and counts["atomc.rope_and_write_kv"] == 0
    assert_same(run(gm, inputs), run(after, inputs))  # no cache: one causal sequence


def test_same_cache_over_prefill_and_decode():
    gm, inputs, _, _, after = graphs(qk_norm=True)
    assert_same_over_prefill_and_decode(gm, after, inputs, arch(qk_norm=True))


def test_without_qk_norms_nothing_changes():
    _, _, fused_rope, result, after = graphs(qk_norm=False)
    assert (result.matched, result.rewritten) == (1, 0)
    assert ops(after) == ops(fused_rope)
