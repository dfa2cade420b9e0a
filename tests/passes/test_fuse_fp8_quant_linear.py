"""A per-token FP8 quant read by one FP8 GEMM -> fp8_linear_dynamic: graph before/after, what it
declines, and the numbers (the op's reference is the composition it replaces)."""

import pytest
import torch
from pass_helpers import FP8Linear, apply, assert_same, capture, ops, run

from atomc.passes.canonicalize import Canonicalize
from atomc.passes.fuse_fp8_quant_linear import FuseFP8QuantLinear
from atomc.passes.fuse_silu_mul import FuseSiluMul
from atomc.passes.fuse_silu_mul_fp8_quant import FuseSiluMulFP8Quant
from atomc.passes.share_fp8_quant import ShareFP8Quant


def mlp(gate_up: FP8Linear, down: FP8Linear):
    def f(x):
        g, u = gate_up(x).chunk(2, dim=-1)
        return down(torch.nn.functional.silu(g) * u)

    return f


def prepared(fn, x, passes=()):
    # the token dim symbolic, the row static, as in a model's graph (the pass compares the quant's
    # group with the row length)
    torch._dynamo.mark_dynamic(x, 0)
    gm, inputs = capture(fn, x, dynamic=None)
    for p in (Canonicalize(), *passes):
        _, gm = apply(p, gm)
    return gm, inputs


def test_both_quants_of_an_mlp_join_their_linears():
    f = mlp(FP8Linear(512, 256, "token", 1), FP8Linear(256, 256, "token", 2))
    before, inputs = prepared(f, torch.randn(4, 256), passes=(FuseSiluMul(), FuseSiluMulFP8Quant()))
    c = ops(before)
    assert c["atomc.fp8_quant_dynamic"] == 1 and c["atomc.silu_and_mul_fp8_quant_dynamic"] == 1
    assert c["atomc.fp8_gemm"] == 2
    result, after = apply(FuseFP8QuantLinear("cuda"), before)
    assert (result.matched, result.rewritten) == (2, 2)
    c = ops(after)
    assert c["atomc.fp8_linear_dynamic"] == 2 and c["atomc.fp8_gemm"] == 0
    assert c["atomc.fp8_quant_dynamic"] == 0 and c["atomc.silu_and_mul_fp8_quant_dynamic"] == 0
    silu = sorted(n.args[6] for n in after.graph.nodes if "fp8_linear_dynamic" in str(n.target))
    assert silu == [False, True]
    assert_same(run(before, inputs), run(after, inputs))


def test_declines_a_shared_quant_static_scales_blocks_and_rocm():
    # two GEMMs reading one quant (share_fp8_quant joined q/k/v kept apart): nothing to own
    a, b = FP8Linear(64, 256, "token", 1), FP8Linear(32, 256, "token", 2)
    before, inputs = prepared(lambda x: (a(x), b(x)), torch.randn(4, 256), passes=(ShareFP8Quant(),))
    assert ops(before)["atomc.fp8_quant_dynamic"] == 1
    result, after = apply(FuseFP8QuantLinear("cuda"), before)
    assert (result.matched, result.rewritten) == (0, 0) and ops(after)["atomc.fp8_gemm"] == 2
    for activation in ("static", "tensor", "group"):
        lin = FP8Linear(64, 256, activation, 3)
        before, _ = prepared(lin, torch.randn(4, 256))
        result, _ = apply(FuseFP8QuantLinear("cuda"), before)
        assert result.rewritten == 0, activation
    lin = FP8Linear(64, 256, "token", 3)
    before, _ = prepared(lin, torch.randn(4, 256))
    result, after = apply(FuseFP8QuantLinear("rocm"), before)
    assert (result.matched, result.rewritten) == (1, 0) and "rocm" in result.notes


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_one_linear_on_the_platforms_that_take_it(platform):
    lin = FP8Linear(64, 256, "token", 4)
    before, inputs = prepared(lin, torch.randn(3, 256))
    result, after = apply(FuseFP8QuantLinear(platform), before)
    assert (result.matched, result.rewritten) == (1, 1)
    assert ops(after)["atomc.fp8_linear_dynamic"] == 1
    assert_same(run(before, inputs), run(after, inputs))
