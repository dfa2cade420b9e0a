"""The pass shell (FusionPass), match.calls, and why erase_dead instead of FX's dead-code removal."""

from __future__ import annotations

import operator

import torch
from pass_helpers import capture

from atomc.passes import match
from atomc.passes.base import FusionPass
from atomc.passes.rewrite import erase_dead


def _graph():
    def f(x, y):
        return torch.neg(x) + torch.neg(y) * 2 + torch.neg(x * y)

    return capture(f, torch.randn(4), torch.randn(4))[0]


class NegToAbsOfArgs(FusionPass):
    """Test pass: neg(placeholder) -> abs(placeholder); neg of anything else is no match; neg(y)
    is declined."""

    name = "neg_to_abs"
    anchor = torch.neg

    def match(self, node):
        return node if node.args[0].op == "placeholder" else None

    def rewrite(self, gm, node) -> bool:
        if node.args[0].name.endswith("y_"):
            return False
        node.target = torch.abs
        return True


def test_fusion_pass_counts_matches_and_rewrites():
    gm = _graph()
    assert len(match.calls(gm, torch.neg)) == 3
    result = NegToAbsOfArgs()(gm)
    assert (result.matched, result.rewritten) == (2, 1)  # neg(x*y) no match, neg(y) declined
    assert len(match.calls(gm, torch.neg)) == 2 and len(match.calls(gm, torch.abs)) == 1
    assert len(match.calls(gm, "add")) == 2 and match.calls(gm, (torch.neg, torch.abs)) != []


def test_erase_dead_keeps_in_place_calls_fx_dce_drops():
    def f(x):
        out = torch.empty_like(x)
        out.copy_(x * 2)  # the result of copy_ is unused: only its effect on `out` matters
        return out

    gm, _ = capture(f, torch.randn(4))
    mul = next(n for n in gm.graph.nodes if n.target is operator.mul)
    erase_dead(gm.graph, [mul])  # still read by copy_: kept
    assert any(n.target == "copy_" for n in gm.graph.nodes) and mul.graph is not None
    gm.graph.eliminate_dead_code()  # FX's own DCE: the write into `out` is gone
    assert not any(n.target == "copy_" for n in gm.graph.nodes)
