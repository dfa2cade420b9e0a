"""linear -> residual add + RMSNorm (+ FP8 quant) -> one op: graph before/after, what it declines, and
the numbers (the fused ops' reference bodies are the compositions they replace: equal on the CPU)."""

import pytest
import torch
from pass_helpers import FP8Linear, apply, assert_same, capture, decoder_graph, ops, run, through

from atomc.passes.canonicalize import Canonicalize
from atomc.passes.decode_gemv import DecodeGemv
from atomc.passes.fuse_add_rmsnorm import FuseAddRMSNorm
from atomc.passes.fuse_fp8_quant_linear import FuseFP8QuantLinear
from atomc.passes.fuse_linear_add_rmsnorm import FuseLinearAddRMSNorm
from atomc.passes.fuse_rmsnorm_fp8_quant import FuseRMSNormFP8Quant
from atomc.passes.fuse_silu_mul import FuseSiluMul
from atomc.passes.noop_elimination import NoopElimination
from atomc.passes.share_fp8_quant import ShareFP8Quant
from models.layers.norm import RMSNorm

BF16_PASSES = (NoopElimination(), Canonicalize(), FuseAddRMSNorm(), FuseSiluMul(), DecodeGemv("cuda"))


def test_a_decoder_layers_o_and_down_projections_take_their_norms():
    gm, inputs = decoder_graph(tokens=5)
    before = through(gm, *BF16_PASSES)
    c = ops(before)
    assert c["atomc.fused_add_rms_norm"] == 2 and c["atomc.linear"] == 4  # qkv, o, gate_up, down
    result, after = apply(FuseLinearAddRMSNorm("cuda"), before)
    assert (result.matched, result.rewritten) == (2, 2)
    c = ops(after)
    assert c["atomc.linear_add_rms_norm"] == 2 and c["atomc.fused_add_rms_norm"] == 0
    assert c["atomc.linear"] == 2  # qkv and gate_up read a norm's output, not a residual add
    fused = [n for n in after.graph.nodes if n.target is torch.ops.atomc.linear_add_rms_norm.default]
    weights = {n.args[1].target if n.args[1].op == "get_attr" else n.args[1].name for n in fused}
    assert len(weights) == 2  # o_proj's and down_proj's weights
    assert_same(run(before, inputs), run(after, inputs))
    assert_same(run(gm, inputs), run(after, inputs))


def test_declines_a_linear_with_another_reader_and_other_platforms():
    torch.manual_seed(1)
    lin, norm = torch.nn.Linear(32, 64), RMSNorm(64, 1e-6)

    def two_readers(x, r):
        y = lin(x)
        return norm(y + r), y * 2

    gm, _ = capture(two_readers, torch.randn(3, 32), torch.randn(3, 64))
    before = through(gm, *BF16_PASSES)
    result, after = apply(FuseLinearAddRMSNorm("cuda"), before)
    assert (result.matched, result.rewritten) == (0, 0) and ops(after)["atomc.fused_add_rms_norm"] == 1

    gm, _ = capture(lambda x, r: norm(lin(x) + r), torch.randn(3, 32), torch.randn(3, 64))
    for platform in ("cpu", "rocm"):  # F.linear stays there: no atomc.linear to match
        result, _ = apply(FuseLinearAddRMSNorm(platform), through(gm, NoopElimination(), Canonicalize(),
                                                                  FuseAddRMSNorm(), DecodeGemv(platform)))  # fmt: skip
        assert result.rewritten == 0
    result, _ = apply(FuseLinearAddRMSNorm("rocm"), through(gm, *BF16_PASSES))  # a cuda graph on rocm
    assert (result.matched, result.rewritten) == (1, 0) and "rocm" in result.notes


def fp8_block(o: FP8Linear, nxt: FP8Linear, norm: RMSNorm):
    """o projection -> residual add + norm -> the next FP8 linear (which makes the norm quantise)."""

    def f(x, r):
        h = o(x) + r
        return nxt(norm(h)), h * 2

    return f


@pytest.mark.parametrize("rows", [1, 4])
def test_fp8_linear_and_norm_quant_become_one_op(rows):
    torch.manual_seed(2)
    norm = RMSNorm(256, 1e-6)
    torch.nn.init.normal_(norm.weight, 1.0, 0.3)
    f = fp8_block(FP8Linear(256, 128, "token", 1), FP8Linear(64, 256, "token", 2), norm)
    x, r = torch.randn(rows, 128), torch.randn(rows, 256)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(r, 0)
    gm, inputs = capture(f, x, r, dynamic=None)
    before = through(gm, NoopElimination(), Canonicalize(), FuseAddRMSNorm(), ShareFP8Quant(),
                     FuseRMSNormFP8Quant(), FuseFP8QuantLinear("cuda"))  # fmt: skip
    c = ops(before)
    assert c["atomc.fp8_linear_dynamic"] == 1 and c["atomc.fused_add_rms_norm_fp8_quant_dynamic"] == 1
    result, after = apply(FuseLinearAddRMSNorm("cuda"), before)
    assert (result.matched, result.rewritten) == (1, 1)
    c = ops(after)
    assert c["atomc.fp8_linear_add_rms_norm_quant"] == 1
    assert c["atomc.fp8_linear_dynamic"] == 0 and c["atomc.fused_add_rms_norm_fp8_quant_dynamic"] == 0
    assert c["atomc.fp8_gemm"] == 1  # the next linear reads the fused op's (q, s)
    assert_same(run(before, inputs), run(after, inputs))


def test_uuid_depends_on_platform():
    assert FuseLinearAddRMSNorm("cuda").uuid() != FuseLinearAddRMSNorm("cpu").uuid()


def test_the_compile_report_counts_the_fused_linears_at_their_size():
    from atomc.graphs.report import graph_flops

    gm, _ = decoder_graph(tokens=5)
    before = through(gm, *BF16_PASSES)
    _, after = apply(FuseLinearAddRMSNorm("cuda"), before)
    assert graph_flops(after)["linear_per_token"] == graph_flops(before)["linear_per_token"] > 0

    torch.manual_seed(2)
    f = fp8_block(FP8Linear(256, 128, "token", 1), FP8Linear(64, 256, "token", 2), RMSNorm(256, 1e-6))
    x, r = torch.randn(3, 128), torch.randn(3, 256)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(r, 0)
    gm, _ = capture(f, x, r, dynamic=None)
    before = through(gm, NoopElimination(), Canonicalize(), FuseAddRMSNorm(), ShareFP8Quant(),
                     FuseRMSNormFP8Quant(), FuseFP8QuantLinear("cuda"))  # fmt: skip
    _, after = apply(FuseLinearAddRMSNorm("cuda"), before)
    flops = graph_flops(after)
    assert flops["fp8_linear_share"] == 1.0
    assert flops["linear_per_token"] == graph_flops(before)["linear_per_token"] == 2 * (256 * 128 + 64 * 256)
