import pytest
import torch
from pass_helpers import apply, assert_same, capture, ops, run

from atomc.passes.fuse_moe_router import FuseMoERouter
from models.layers.moe import MoESpec, SparseMoEBlock


def block(router_bias: bool) -> SparseMoEBlock:
    torch.manual_seed(0)
    b = SparseMoEBlock(32, MoESpec(num_experts=8, top_k=2, intermediate_size=16, router_bias=router_bias))
    for p in b.parameters():
        p.data.normal_()
    return b


@pytest.mark.parametrize("router_bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 5])
def test_router_linear_folds_into_the_moe_op(router_bias, tokens):
    b = block(router_bias)
    gm, inputs = capture(lambda x: b(x), torch.randn(tokens, 32))
    assert ops(gm)["linear"] == 1 and ops(gm)["atomc.moe"] == 1
    result, after = apply(FuseMoERouter("cuda"), gm)
    assert (result.matched, result.rewritten) == (1, 1)
    counts = ops(after)
    assert counts["atomc.moe_routed"] == 1 and counts["atomc.moe"] == 0 and counts["linear"] == 0
    fused = next(n for n in after.graph.nodes if n.target is torch.ops.atomc.moe_routed.default)
    assert fused.args[2] is not None if router_bias else fused.args[2] is None  # the bias goes along
    # the op's reference body is the same linear and moe: the same numbers, before and after
    assert_same(run(gm, inputs), run(after, inputs))


def test_other_platforms_keep_the_pair():
    b = block(False)
    gm, _ = capture(lambda x: b(x), torch.randn(3, 32))
    result, after = apply(FuseMoERouter("cpu"), gm)
    assert (result.matched, result.rewritten) == (1, 0) and ops(after) == ops(gm)
    assert "kept apart on cpu" in result.notes


def test_logits_read_elsewhere_or_of_another_input_are_left_alone():
    b = block(False)
    experts = b.experts

    def logits_returned(x):
        logits = b.gate(x)
        return experts(x, logits), logits

    def router_of_another_tensor(x, y):
        return experts(x, b.gate(y))

    x, y = torch.randn(3, 32), torch.randn(3, 32)
    cases = [(logits_returned, (x,)), (router_of_another_tensor, (x, y))]
    for fn, args in cases:
        gm, inputs = capture(fn, *args)
        result, after = apply(FuseMoERouter("cuda"), gm)
        assert (result.matched, result.rewritten) == (1, 0)
        assert ops(after) == ops(gm)
        assert_same(run(gm, inputs), run(after, inputs))
