"""The graph cut: at the registry's context ops only, and an atomc op nobody listed stops the build."""

from __future__ import annotations

import pytest
import torch

from atomc.graphs import partition
from atomc.kernels import registry


@torch.library.custom_op("atomc::unlisted_test_op", mutates_args=())
def unlisted_test_op(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@unlisted_test_op.register_fake
def _(x):
    return torch.empty_like(x)


def _graph(*targets):
    g = torch.fx.Graph()
    x = g.placeholder("x")
    for t in targets:
        x = g.call_function(t, (x,))
    g.output(x)
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_splitting_ops_are_the_registry_context_ops():
    assert set(partition.splitting_ops()) == set(registry.splitting_op_names())
    assert "atomc::all_reduce" not in partition.splitting_ops()


def test_plan_cuts_at_context_ops_only():
    gm = _graph(torch.relu, torch.ops.atomc.rms_norm.default, torch.neg)
    assert partition.partition_plan(gm) == [{"kind": "graph", "nodes": 3, "index": 0}]
    g = torch.fx.Graph()
    pos, q, k, v, cs = (g.placeholder(n) for n in ("pos", "q", "k", "v", "cs"))
    rk = g.call_function(torch.ops.atomc.rope_and_write_kv.default, (pos, q, k, v, cs, 0))
    g.call_function(torch.neg, (rk,))
    g.output(None)
    plan = partition.partition_plan(torch.fx.GraphModule(torch.nn.Module(), g))
    assert [p["kind"] for p in plan] == ["split", "graph"] and plan[0]["op"] == "atomc::rope_and_write_kv"


def test_an_unlisted_atomc_op_fails_loudly():
    gm = _graph(torch.ops.atomc.unlisted_test_op.default)
    with pytest.raises(partition.UnknownAtomcOp, match="atomc::unlisted_test_op.*registry"):
        partition.splitting_ops_in(gm)
    with pytest.raises(partition.UnknownAtomcOp):
        partition.partition_plan(gm)
