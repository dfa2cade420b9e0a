"""One quant for an activation several FP8 linears read: graph before/after, what stays apart, numbers."""

import torch
from pass_helpers import FP8Linear, apply, assert_same, capture, ops, run

from atomc.passes.share_fp8_quant import ShareFP8Quant


def test_qkv_kept_apart_quantise_their_input_once():
    q, k, v = (FP8Linear(64, 128, "token", s) for s in range(3))
    gm, inputs = capture(lambda x: (q(x), k(x), v(x)), torch.randn(5, 128))
    assert ops(gm)["atomc.fp8_quant_dynamic"] == 3
    result, after = apply(ShareFP8Quant(), gm)
    assert (result.matched, result.rewritten) == (2, 2)
    c = ops(after)
    assert c["atomc.fp8_quant_dynamic"] == 1 and c["atomc.fp8_gemm"] == 3
    assert c["getitem"] == 2  # one q and one scale, read by the three GEMMs
    assert_same(run(gm, inputs), run(after, inputs))


def test_static_scales_are_shared_only_when_they_are_the_same_scale():
    a, b = FP8Linear(64, 128, "static", 0), FP8Linear(64, 128, "static", 1)  # two calibrated scales

    def f(x):
        return a(x), b(x), a(x)  # a's second call: same x, same scale

    gm, inputs = capture(f, torch.randn(5, 128))
    assert ops(gm)["atomc.fp8_quant_static"] == 3
    result, after = apply(ShareFP8Quant(), gm)
    assert (result.matched, result.rewritten) == (1, 1) and ops(after)["atomc.fp8_quant_static"] == 2
    assert_same(run(gm, inputs), run(after, inputs))


def test_different_inputs_or_groups_stay_apart():
    tok, blk = FP8Linear(64, 256, "token"), FP8Linear(64, 256, "group")
    gm, _ = capture(lambda x, y: (tok(x), tok(y), blk(x)), torch.randn(5, 256), torch.randn(5, 256))
    result, after = apply(ShareFP8Quant(), gm)
    assert (result.matched, result.rewritten) == (0, 0) and ops(after)["atomc.fp8_quant_dynamic"] == 3
