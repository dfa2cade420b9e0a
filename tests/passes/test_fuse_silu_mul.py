import torch
import torch.nn.functional as F
from pass_helpers import apply, assert_same, capture, ops, randomize, run

from atomc.passes.canonicalize import Canonicalize
from atomc.passes.fuse_silu_mul import FuseSiluMul
from models.layers.mlp import GatedMLP


def canonical(mlp):
    gm, inputs = capture(mlp, torch.randn(5, 16))
    _, canon = apply(Canonicalize(), gm)
    return gm, inputs, canon


def test_merged_gate_up_becomes_silu_and_mul():
    gm, inputs, canon = canonical(randomize(GatedMLP(16, 24, bias=False)))
    assert ops(canon)["atomc.silu_mul"] == 1 and ops(canon)["method.split"] == 1
    result, after = apply(FuseSiluMul(), canon)
    assert (result.matched, result.rewritten) == (1, 1)
    counts = ops(after)
    assert counts["atomc.silu_and_mul"] == 1 and counts["atomc.silu_mul"] == 0
    assert counts["method.split"] == 0 and counts["getitem"] == 0
    assert_same(run(gm, inputs), run(after, inputs))


def test_chunk_form_also_fuses():
    def f(y):
        g, u = y.chunk(2, dim=-1)
        return torch.nn.functional.silu(g) * u

    gm, inputs = capture(f, torch.randn(5, 48))
    _, canon = apply(Canonicalize(), gm)
    result, after = apply(FuseSiluMul(), canon)
    assert result.rewritten == 1 and ops(after)["atomc.silu_and_mul"] == 1
    assert_same(run(gm, inputs), run(after, inputs))


def test_separate_gate_and_up_stay_silu_mul():
    def separate(x, w_gate, w_up):  # two GEMMs: no split to fold
        return F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)

    gm, inputs = capture(separate, torch.randn(5, 16), torch.randn(24, 16), torch.randn(24, 16))
    _, canon = apply(Canonicalize(), gm)
    result, after = apply(FuseSiluMul(), canon)
    assert (result.matched, result.rewritten) == (1, 0) and ops(after)["atomc.silu_mul"] == 1
