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
    """A tiny ModelArch stand-in: the head counts the shared layers are built from."""
    base = dict(
        num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64, intermediate_size=96,
        qkv_bias=False, o_bias=False, qk_norm=False, rms_norm_eps=1e-6, mlp_bias=False,
        num_layers=1, vocab_size=128, max_position_embeddings=64,
    )  # fmt: skip
    base.update(kw)
    return SimpleNamespace(**base)


def randomize(module: torch.nn.Module, std: float = 0.1) -> torch.nn.Module:
    """Layers create their weights uninitialised (the loader fills them): give them random values,
    norm weights around 1."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
            else:
                p.normal_(0, std)
    return module


def attention(a, layer_idx: int = 0):
    """models.layers.attention.LlamaStyleAttention for the stand-in `a`, with random weights."""
    from models.arch import layer_sliding_window
    from models.layers.attention import LlamaStyleAttention

    qk_eps = a.rms_norm_eps if a.qk_norm else None
    attn = LlamaStyleAttention(
        a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, layer_idx,
        qkv_bias=a.qkv_bias, o_bias=a.o_bias, qk_norm_eps=qk_eps, sliding_window=layer_sliding_window(a, layer_idx),
    )  # fmt: skip
    return randomize(attn)


def decoder_layer(a, layer_idx: int = 0):
    from models.decoder import DecoderConfig, llama_style_layer

    cfg = DecoderConfig(
        arch=a, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size, rms_norm_eps=a.rms_norm_eps,
        rope_theta=10000.0, rope_scaling=None, qkv_bias=a.qkv_bias, o_bias=a.o_bias, mlp_bias=a.mlp_bias,
        qk_norm=a.qk_norm,
    )  # fmt: skip
    return randomize(llama_style_layer(cfg, layer_idx))


def decoder_graph(tokens: int = 6):
    """A traced Llama decoder layer + final norm (fp32) and its inputs, with the weight layout atomc
    loads (qkv_proj and gate_up_proj merged)."""
    from models.layers.norm import RMSNorm
    from models.layers.rotary import RotaryEmbedding

    a = arch()
    torch.manual_seed(0)
    layer, rope, norm = decoder_layer(a), RotaryEmbedding(a.head_dim, 64, 10000.0, None), RMSNorm(64, 1e-6)
    return capture(lambda p, x: norm(layer(p, x, rope)), torch.arange(tokens), torch.randn(tokens, a.hidden_size))


def through(gm, *passes):
    for p in passes:
        _, gm = apply(p, gm)
    return gm


class FP8Linear(torch.nn.Module):
    """A linear with models/quant/fp8.py's method and random e4m3 weights: its forward is the
    method's apply, so a traced graph holds the quant -> GEMM ops a quantised model emits.
    `activation`: "static", "tensor", "token" (per-channel weights) or "group" (128x128 blocks)."""

    def __init__(self, n: int, k: int, activation: str = "token", seed: int = 0):
        super().__init__()
        from models.quant.fp8 import method_for
        from models.quant.spec import FP8Scheme

        g = torch.Generator().manual_seed(seed)
        if activation == "group":
            scheme = FP8Scheme("block", "group", (128, 128))
            scale_name, scale = "weight_scale_inv", torch.rand(-(-n // 128), k // 128, generator=g) / 50
        else:
            scheme = FP8Scheme("channel", activation)
            scale_name, scale = "weight_scale", torch.rand(n, generator=g) / 50
        self.method = method_for(scheme)
        self.input_size_per_partition = k
        w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        self.weight = torch.nn.Parameter(w, requires_grad=False)
        self.register_parameter(scale_name, torch.nn.Parameter(scale, requires_grad=False))
        if activation == "static":
            self.input_scale = torch.nn.Parameter(torch.tensor([0.02]), requires_grad=False)

    def forward(self, x):
        return self.method.apply(self, x, None)
