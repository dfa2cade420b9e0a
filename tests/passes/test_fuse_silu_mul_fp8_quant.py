"""SiLU·mul (merged gate_up) -> FP8 quant: graph before/after, what it declines, and the numbers."""

import pytest
import torch
from pass_helpers import FP8Linear, apply, assert_same, capture, ops, run

from atomc.passes.canonicalize import Canonicalize
from atomc.passes.fuse_silu_mul import FuseSiluMul
from atomc.passes.fuse_silu_mul_fp8_quant import FuseSiluMulFP8Quant


def mlp(gate_up: FP8Linear, down: FP8Linear, reader=None):
    def f(x):
        g, u = gate_up(x).chunk(2, dim=-1)
        a = torch.nn.functional.silu(g) * u
        return (down(a), reader(a)) if reader else down(a)

    return f


def prepared(fn, *args):
    gm, inputs = capture(fn, *args)
    _, canon = apply(Canonicalize(), gm)
    _, fused = apply(FuseSiluMul(), canon)
    return gm, inputs, fused


@pytest.mark.parametrize("activation", ["token", "group", "static"])
def test_silu_and_mul_then_quant_becomes_one_op(activation):
    f = mlp(FP8Linear(512, 256, activation, 1), FP8Linear(128, 256, activation, 2))
    gm, inputs, before = prepared(f, torch.randn(4, 256))
    kind = "static" if activation == "static" else "dynamic"
    assert ops(before)["atomc.silu_and_mul"] == 1 and ops(before)[f"atomc.fp8_quant_{kind}"] == 2
    result, after = apply(FuseSiluMulFP8Quant(), before)
    assert (result.matched, result.rewritten) == (1, 1)  # the gate_up input's quant is no match
    c = ops(after)
    assert c[f"atomc.silu_and_mul_fp8_quant_{kind}"] == 1 and c["atomc.silu_and_mul"] == 0
    assert c[f"atomc.fp8_quant_{kind}"] == 1
    assert_same(run(gm, inputs), run(after, inputs))


def test_declines_an_activation_with_another_reader_and_a_per_tensor_scale():
    f = mlp(FP8Linear(512, 256, "token", 1), FP8Linear(128, 256, "token", 2), reader=lambda a: a.sum(-1))
    _, _, before = prepared(f, torch.randn(4, 256))
    result, after = apply(FuseSiluMulFP8Quant(), before)
    assert (result.matched, result.rewritten) == (1, 0) and ops(after)["atomc.silu_and_mul"] == 1

    f = mlp(FP8Linear(512, 256, "tensor", 1), FP8Linear(128, 256, "tensor", 2))
    _, _, before = prepared(f, torch.randn(4, 256))
    result, after = apply(FuseSiluMulFP8Quant(), before)
    assert (result.matched, result.rewritten) == (1, 0)
