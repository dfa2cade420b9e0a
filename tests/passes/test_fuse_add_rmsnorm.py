import torch
from pass_helpers import apply, assert_same, capture, ops, run

from atomc.passes.canonicalize import Canonicalize
from atomc.passes.fuse_add_rmsnorm import FuseAddRMSNorm
from atomc.passes.noop_elimination import NoopElimination
from models.layers.norm import RMSNorm

norm = RMSNorm(32, 1e-6)
torch.nn.init.normal_(norm.weight)


def canonical(fn, *args):
    gm, inputs = capture(fn, *args)
    _, clean = apply(NoopElimination(), gm)
    _, canon = apply(Canonicalize(), clean)
    return gm, inputs, canon


def residual_block(x, r):
    h = x + r
    return norm(h), h * 3  # the residual stream goes on from h


def test_add_then_norm_becomes_one_op():
    gm, inputs, canon = canonical(residual_block, torch.randn(5, 32), torch.randn(5, 32))
    assert ops(canon)["atomc.rms_norm"] == 1 and ops(canon)["add"] == 1
    result, after = apply(FuseAddRMSNorm(), canon)
    assert (result.matched, result.rewritten) == (1, 1)
    counts = ops(after)
    assert counts["atomc.fused_add_rms_norm"] == 1 and counts["atomc.rms_norm"] == 0 and counts["add"] == 0
    assert_same(run(gm, inputs), run(after, inputs))


def test_broadcast_add_is_not_a_residual():
    bias = torch.randn(32)
    gm, inputs, canon = canonical(lambda x: norm(x + bias), torch.randn(5, 32))
    result, after = apply(FuseAddRMSNorm(), canon)
    assert result.matched == 0 and ops(after)["atomc.rms_norm"] == 1
