"""Trace small functions with Dynamo (the graphs atomc's passes really see) and compare graphs."""

from __future__ import annotations

import copy
from collections import Counter
from types import SimpleNamespace

import torch

import atomc.ops  # noqa: F401


def capture(fn, *args, dynamic: bool = True):
    """(GraphModule, example inputs) of fn as Dynamo hands them to a backend."""
    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, list(example_inputs)))
        return gm

    with torch.no_grad():
        torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)(*args)
    gm, inputs = seen[-1]  # Dynamo may restart analysis once; the last graph is the one it keeps
    # symbolic sizes arrive as SymInts: the graph runs on their concrete values
    return gm, [x.node.hint if isinstance(x, torch.SymInt) else x for x in inputs]


def run(gm, inputs):
    # fresh copies: some graphs write into their inputs (attention outputs, KV caches)
    inputs = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
    with torch.no_grad():
        return gm(*inputs)


def apply(pass_, gm):
    """Run one pass on a copy of gm; returns (result, new gm)."""
    gm = copy.deepcopy(gm)
    result = pass_(gm)
    gm.graph.lint()
    gm.recompile()
    return result, gm


def ops(gm) -> Counter:
    """How many nodes call each op: 'atomc.rms_norm', 'method.float', 'mul', 'linear', ..."""
    out = Counter()
    for n in gm.graph.nodes:
        if n.op == "call_method":
            out[f"method.{n.target}"] += 1
        elif n.op == "call_function":
            out[_name(n.target)] += 1
    return out


def _name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.replace("::", ".")
    return getattr(target, "__name__", str(target))


def assert_same(a, b, atol=0.0, rtol=0.0):
    a = a if isinstance(a, (tuple, list)) else (a,)
    b = b if isinstance(b, (tuple, list)) else (b,)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=atol, rtol=rtol)


def arch(**kw):
    """A tiny ModelArch stand-in for building models.llama / models.layers modules directly."""
    base = dict(
        num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64, intermediate_size=96,
        qkv_bias=False, o_bias=False, qk_norm=False, rms_norm_eps=1e-6, mlp_bias=False,
    )  # fmt: skip
    base.update(kw)
    return SimpleNamespace(**base)


def decoder_graph(merge: bool = True, tokens: int = 6):
    """A traced Llama decoder layer + final norm (fp32) and its inputs, merged at load like atomc does."""
    from models.layers import RMSNorm, RotaryEmbedding
    from models.llama import DecoderLayer

    a = arch()
    torch.manual_seed(0)
    layer, rope, norm = DecoderLayer(a, 0), RotaryEmbedding(a.head_dim, 64, 10000.0, None), RMSNorm(64, 1e-6)
    if merge:
        layer.self_attn.merge_qkv()
        layer.mlp.merge_gate_up()
    return capture(lambda p, x: norm(layer(p, x, rope)), torch.arange(tokens), torch.randn(tokens, a.hidden_size))


def through(gm, *passes):
    for p in passes:
        _, gm = apply(p, gm)
    return gm
