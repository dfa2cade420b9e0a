import pytest
import torch
import torch.nn.functional as F
from pass_helpers import apply, assert_same, capture, ops, randomize, run

from atomc.passes.canonicalize import Canonicalize
from atomc.passes.noop_elimination import NoopElimination
from models.layers.mlp import GatedMLP
from models.layers.norm import RMSNorm
from models.layers.rotary import RotaryEmbedding


def canonical(fn, *args):
    gm, inputs = capture(fn, *args)
    _, clean = apply(NoopElimination(), gm)
    result, after = apply(Canonicalize(), clean)
    return gm, inputs, result, after


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(dtype):
    norm = RMSNorm(32, 1e-5).to(dtype)
    torch.nn.init.normal_(norm.weight)
    gm, inputs, result, after = canonical(norm, torch.randn(2, 3, 32, dtype=dtype))
    assert "rms_norm=1/1" in result.notes
    counts = ops(after)
    assert counts["atomc.rms_norm"] == 1
    assert not {"rsqrt", "method.pow", "method.mean", "method.float", "method.to"} & set(counts)
    assert_same(run(gm, inputs), run(after, inputs))


def test_rms_norm_with_shared_intermediate_is_left_alone():
    def f(x, w):
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return w * (x * r), r  # r is an output too: rewriting would compute the norm twice

    gm, inputs, result, after = canonical(f, torch.randn(4, 8), torch.randn(8))
    assert (result.matched, result.rewritten) == (1, 0)
    assert ops(after)["atomc.rms_norm"] == 0
    assert_same(run(gm, inputs), run(after, inputs))


def test_silu_mul_and_linear():
    mlp = randomize(GatedMLP(16, 24, bias=True))
    gm, inputs, result, after = canonical(mlp, torch.randn(5, 16))
    counts = ops(after)
    assert counts["atomc.silu_mul"] == 1 and counts["silu"] == 0 and counts["mul"] == 0
    assert counts["linear"] == 2  # gate_up_proj (one GEMM for both) and down_proj
    assert "linear=0/2" in result.notes  # F.linear is already the canonical spelling
    assert_same(run(gm, inputs), run(after, inputs))


def test_aten_linear_gets_one_spelling():
    def f(x, w):
        return torch.ops.aten.linear.default(x, w) + F.linear(x, w)

    gm, inputs, result, after = canonical(f, torch.randn(3, 4), torch.randn(5, 4))
    assert "linear=1/2" in result.notes
    assert {n.target for n in after.graph.nodes if "linear" in str(n.target)} == {F.linear}
    assert_same(run(gm, inputs), run(after, inputs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope(dtype):
    rope = RotaryEmbedding(16, 64, 10000.0, None).to(dtype)
    positions = torch.randint(0, 64, (7,))
    q, k = torch.randn(7, 4, 16, dtype=dtype), torch.randn(7, 2, 16, dtype=dtype)
    gm, inputs, result, after = canonical(rope, positions, q, k)
    assert "rope=1/1" in result.notes
    counts = ops(after)
    assert counts["atomc.rope"] == 1
    assert not {"cat", "neg", "mul", "add", "method.chunk"} & set(counts)
    assert_same(run(gm, inputs), run(after, inputs))


def test_attention_is_already_canonical():
    def f(q, k, v):
        out = torch.empty_like(q)
        torch.ops.atomc.attention(q, k, v, out, 0, 0.25)
        return out

    gm, inputs, result, after = canonical(f, torch.randn(5, 4, 16), torch.randn(5, 2, 16), torch.randn(5, 2, 16))
    assert "attention=0/1" in result.notes and ops(after)["atomc.attention"] == 1
    assert_same(run(gm, inputs), run(after, inputs))
