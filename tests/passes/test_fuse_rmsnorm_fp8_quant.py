"""RMSNorm (plain, and fused with the residual add) -> FP8 quant: graph before/after, what it declines,
and the numbers (the fused op's torch body is the composition it replaces: equal on the CPU)."""

import pytest
import torch
from pass_helpers import FP8Linear, apply, assert_same, capture, ops, run

from atomc.passes.canonicalize import Canonicalize
from atomc.passes.fuse_add_rmsnorm import FuseAddRMSNorm
from atomc.passes.fuse_rmsnorm_fp8_quant import FuseRMSNormFP8Quant
from atomc.passes.noop_elimination import NoopElimination
from atomc.passes.share_fp8_quant import ShareFP8Quant
from models.layers.norm import RMSNorm

torch.manual_seed(0)
norm = RMSNorm(256, 1e-6)
torch.nn.init.normal_(norm.weight, 1.0, 0.3)


def prepared(fn, *args):
    gm, inputs = capture(fn, *args)
    after = gm
    for p in (NoopElimination(), Canonicalize(), FuseAddRMSNorm(), ShareFP8Quant()):
        _, after = apply(p, after)
    return gm, inputs, after


@pytest.mark.parametrize("activation", ["token", "group", "static"])
def test_residual_norm_then_quant_becomes_one_op(activation):
    lin = FP8Linear(64, 256, activation)

    def block(x, r):
        h = x + r
        return lin(norm(h)), h * 2  # the residual stream goes on from h

    gm, inputs, before = prepared(block, torch.randn(5, 256), torch.randn(5, 256))
    kind = "static" if activation == "static" else "dynamic"
    c = ops(before)
    assert c["atomc.fused_add_rms_norm"] == 1 and c[f"atomc.fp8_quant_{kind}"] == 1
    result, after = apply(FuseRMSNormFP8Quant(), before)
    assert (result.matched, result.rewritten) == (1, 1)
    c = ops(after)
    assert c[f"atomc.fused_add_rms_norm_fp8_quant_{kind}"] == 1
    assert c["atomc.fused_add_rms_norm"] == 0 and c[f"atomc.fp8_quant_{kind}"] == 0
    assert c["atomc.fp8_block_gemm" if activation == "group" else "atomc.fp8_gemm"] == 1
    assert_same(run(gm, inputs), run(after, inputs))


@pytest.mark.parametrize("activation", ["token", "static"])
def test_plain_norm_then_quant(activation):
    lin = FP8Linear(48, 256, activation)
    gm, inputs, before = prepared(lambda x: lin(norm(x)), torch.randn(3, 256))
    result, after = apply(FuseRMSNormFP8Quant(), before)
    assert (result.matched, result.rewritten) == (1, 1)
    kind = "static" if activation == "static" else "dynamic"
    assert ops(after)[f"atomc.rms_norm_fp8_quant_{kind}"] == 1 and ops(after)["atomc.rms_norm"] == 0
    assert_same(run(gm, inputs), run(after, inputs))


def test_norms_shared_by_several_linears_fuse_after_sharing():
    a, b = FP8Linear(48, 256, "token", 1), FP8Linear(32, 256, "token", 2)

    def two(x):
        n = norm(x)
        return a(n), b(n)  # DeepSeek's q_a_proj and kv_a_proj_with_mqa read one normed input

    gm, inputs, before = prepared(two, torch.randn(3, 256))
    assert ops(before)["atomc.fp8_quant_dynamic"] == 1  # shared first
    result, after = apply(FuseRMSNormFP8Quant(), before)
    assert result.rewritten == 1 and ops(after)["atomc.fp8_gemm"] == 2
    assert_same(run(gm, inputs), run(after, inputs))


def test_declines_a_norm_with_a_bf16_reader_and_a_per_tensor_scale():
    lin = FP8Linear(48, 256, "token")
    w_plain = torch.randn(16, 256)

    def mixed(x):
        n = norm(x)
        return lin(n), torch.nn.functional.linear(n, w_plain)  # an unquantised linear reads n too

    _, _, before = prepared(mixed, torch.randn(3, 256))
    result, after = apply(FuseRMSNormFP8Quant(), before)
    assert (result.matched, result.rewritten) == (1, 0) and ops(after)["atomc.rms_norm"] == 1

    per_tensor = FP8Linear(48, 256, "tensor")  # one dynamic scale for the whole tensor (group 0)
    _, _, before = prepared(lambda x: per_tensor(norm(x)), torch.randn(3, 256))
    result, after = apply(FuseRMSNormFP8Quant(), before)
    assert (result.matched, result.rewritten) == (1, 0) and ops(after)["atomc.fp8_quant_dynamic"] == 1


def test_quant_of_something_else_is_no_match():
    lin = FP8Linear(48, 256, "token")
    _, _, before = prepared(lambda x: lin(x * 2), torch.randn(3, 256))
    result, _ = apply(FuseRMSNormFP8Quant(), before)
    assert (result.matched, result.rewritten) == (0, 0)
