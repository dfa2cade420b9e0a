"""fuse_mla_latent_norm_rope on DeepSeek's MLA layer as Dynamo traces it (models/deepseek.py), and on
small graphs that vary one thing of the pattern: what it replaces, what it leaves alone, the numbers
(fp32 on the CPU, the torch reference) with and without a paged latent cache."""

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from pass_helpers import apply, assert_same, capture, ops, randomize, run
from test_fuse_rope_kv_write import BLOCKS, PAGE, context, with_inputs  # shared: pages, context, step inputs

from atomc.forward_context import set_forward_context
from atomc.kv_spec import MLAAttentionSpec
from atomc.ops.mla_latent import mla_latent_norm_rope_reference
from atomc.passes import PassManager
from atomc.passes.canonicalize import Canonicalize
from atomc.passes.fuse_mla_latent_norm_rope import FuseMLALatentNormRope
from atomc.passes.noop_elimination import NoopElimination
from atomc.runtime.kv_cache import allocate_kv_cache
from models.deepseek import DeepseekConfig, MLAAttention
from models.layers.rotary import RotaryEmbedding

HEADS, NOPE, ROPE, LORA, HIDDEN = 4, 16, 8, 32, 64


def mla_layer(interleave: bool, q_lora: int | None):
    c = DeepseekConfig(
        arch=SimpleNamespace(num_heads=HEADS), hidden_size=HIDDEN, intermediate_size=96, rms_norm_eps=1e-6,
        q_lora_rank=q_lora, kv_lora_rank=LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=16,
        attention_bias=False, rope_theta=10000.0, rope_scaling=None, rope_interleave=interleave, softmax_scale=0.2,
        moe=None, moe_layers=frozenset(), shared_intermediate_size=0, correction_bias=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return randomize(MLAAttention(c, 0)), RotaryEmbedding(ROPE, 64, 10000.0, None)


def canonical(fn, *args, dynamic=True):
    gm, inputs = capture(fn, *args, dynamic=dynamic)
    for p in (NoopElimination(), Canonicalize()):
        _, gm = apply(p, gm)
    return gm, inputs


def layer_graphs(interleave=True, q_lora=None):
    attn, rope = mla_layer(interleave, q_lora)
    gm, inputs = canonical(lambda p, x: attn(p, x, rope), torch.arange(5), torch.randn(5, HIDDEN))
    result, after = apply(FuseMLALatentNormRope(), gm)
    return gm, inputs, result, after


FUSED = torch.ops.atomc.mla_latent_norm_rope.default


def fused_calls(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is FUSED]


@pytest.mark.parametrize("q_lora", [None, 24])
@pytest.mark.parametrize("interleave", [True, False])
def test_the_layer_latent_norm_and_rope_become_one_op(interleave, q_lora):
    gm, inputs, result, after = layer_graphs(interleave, q_lora)
    assert (result.matched, result.rewritten) == (1, 1)
    (fused,) = fused_calls(after)
    assert fused.args[-1] is interleave
    # the pattern's nodes, and nothing else, are gone: the norm, the rope and its two outputs, and on
    # interleaved checkpoints the gathers (4 slices, 2 cats); in: the op and its 3 outputs
    gone = Counter({"atomc.rms_norm": 1, "atomc.rope": 1, "getitem": 2 + 4 * interleave, "cat": 2 * interleave})
    came = Counter({"atomc.mla_latent_norm_rope": 1, "getitem": 3})
    assert ops(after) == ops(gm) - gone + came
    assert ops(after)["atomc.rms_norm"] == (1 if q_lora else 0)  # q_a_layernorm is no part of it
    # one GEMM reads x (qkv_a_proj: q's input and the latent with its rope key), then q_b_proj, o_proj
    assert ops(gm)["linear"] == (3 if q_lora else 2)
    assert_same(run(gm, inputs), run(after, inputs))  # no cache: one causal sequence


def test_same_outputs_and_latent_cache_over_prefill_and_decode():
    """mla_attention writes the fused op's outputs to the latent cache: prefill 6 tokens, then decode
    one, through each graph with its own cache; the outputs and the caches agree."""
    gm, inputs, _, after = layer_graphs(interleave=True)
    spec = MLAAttentionSpec(LORA, ROPE)
    caches = {g: allocate_kv_cache([spec], len(BLOCKS), PAGE, torch.float32, "cpu", lambda s: "NHD")[0] for g in "ab"}
    x = torch.randn(7, HIDDEN)
    for start, n in ((0, 6), (6, 1)):
        step = with_inputs(inputs, torch.arange(start, start + n), x[start : start + n])
        outs = {}
        for name, g in (("a", gm), ("b", after)):
            with set_forward_context(context(start, n, caches[name])):
                outs[name] = run(g, step)
        assert_same(outs["a"], outs["b"])
        assert_same(caches["a"], caches["b"])
    assert caches["b"][0].abs().sum() > 0  # the latent really went through the cache


# small graphs of the layer's steps, each varying one thing


def latent_block(variant: str):
    """The steps the pass fuses, written out with the atomc ops (the graph canonicalize leaves):
    'plain' is the layer's; the others change one thing."""

    def gather(x):
        return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)

    def fn(positions, q, kv, w, cos_sin, q_absorbed):
        t = q.shape[0]
        q_pe = q[..., NOPE:]
        c_kv, k_pe = kv.split([LORA, ROPE], dim=-1)
        if variant == "token_weights":  # a weight row per token (broadcast by the norm's reference)
            w = w * (1 + positions[:, None] / 10)
        c = torch.ops.atomc.rms_norm(c_kv, w, 1e-6)
        k_pe = k_pe.reshape(t, 1, ROPE)
        if variant == "gather_q_only":
            q_in, k_in = gather(q_pe), k_pe
        else:
            q_in, k_in = gather(q_pe), gather(k_pe)
        q_rot, k_rot = torch.ops.atomc.rope(positions, q_in, k_in, cos_sin)
        out = q_absorbed.new_empty(t, HEADS, LORA)
        torch.ops.atomc.mla_attention(q_absorbed, q_rot, c, k_rot.view(t, ROPE), out, 0, 0.2)
        if variant == "norm_read_twice":
            return out, c * 2
        return (out,)

    g = torch.Generator().manual_seed(1)
    args = (
        torch.arange(5), torch.randn(5, HEADS, NOPE + ROPE, generator=g), torch.randn(5, LORA + ROPE, generator=g),
        1 + 0.5 * torch.randn(LORA, generator=g), RotaryEmbedding(ROPE, 64, 10000.0, None).cos_sin,
        torch.randn(5, HEADS, LORA, generator=g),
    )  # fmt: skip
    for x in (args[0], args[1], args[2], args[5]):  # only the token dim is symbolic, as in the engine's trace
        torch._dynamo.mark_dynamic(x, 0)
    gm, inputs = canonical(fn, *args, dynamic=False)
    result, after = apply(FuseMLALatentNormRope(), gm)
    return gm, inputs, result, after


def test_the_written_out_steps_fuse_like_the_layer():
    gm, inputs, result, after = latent_block("plain")
    assert (result.matched, result.rewritten) == (1, 1) and fused_calls(after)[0].args[-1] is True
    assert ops(after)["atomc.rms_norm"] == ops(after)["atomc.rope"] == ops(after)["cat"] == 0
    assert_same(run(gm, inputs), run(after, inputs))


@pytest.mark.parametrize("variant", ["norm_read_twice", "token_weights"])
def test_declined_graphs_are_left_alone(variant):
    """A norm with a second reader (fusing would compute it twice); a norm weight of another shape
    than [L] (one row a token: the op scales every row by one vector)."""
    gm, inputs, result, after = latent_block(variant)
    assert (result.matched, result.rewritten) == (1, 0)
    assert after.code == gm.code
    run(after, inputs)  # still a valid graph


def test_a_gather_on_one_side_only_is_read_as_it_is():
    """Only q de-interleaved: the op takes the gathered q and the plain k (the flag covers both)."""
    gm, inputs, result, after = latent_block("gather_q_only")
    assert (result.matched, result.rewritten) == (1, 1)
    (fused,) = fused_calls(after)
    assert fused.args[-1] is False and ops(after)["cat"] == 1  # q's gather stays: the op reads it
    assert_same(run(gm, inputs), run(after, inputs))


def test_a_graph_without_mla_is_not_touched():
    from pass_helpers import decoder_graph

    gm, _ = decoder_graph()
    for p in (NoopElimination(), Canonicalize()):
        _, gm = apply(p, gm)
    result, after = apply(FuseMLALatentNormRope(), gm)
    assert (result.matched, result.rewritten) == (0, 0) and after.code == gm.code


def test_reference_is_the_unfused_steps():
    """The op's reference equals rms_norm + de-interleave + rope run apart, on strided inputs."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(6, HEADS, NOPE + ROPE, generator=g)
    kv = torch.randn(6, LORA + ROPE, generator=g)
    c_kv, k_pe = kv.split([LORA, ROPE], -1)
    k_pe = k_pe.reshape(6, 1, ROPE)
    w, cs, pos = torch.randn(LORA, generator=g), RotaryEmbedding(ROPE, 64, 10000.0, None).cos_sin, torch.arange(3, 9)
    q_rot, k_rot, c = mla_latent_norm_rope_reference(pos, q[..., NOPE:], k_pe, c_kv, w, 1e-6, cs, True)
    gather = [*range(0, ROPE, 2), *range(1, ROPE, 2)]
    want_q, want_k = torch.ops.atomc.rope(pos, q[..., NOPE:][..., gather], k_pe[..., gather], cs)
    assert_same((q_rot, k_rot, c), (want_q, want_k, torch.ops.atomc.rms_norm(c_kv, w, 1e-6)))
    assert q_rot.is_contiguous() and k_rot.is_contiguous() and c.is_contiguous()


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_default_cpu_pipeline_fuses_every_mla_layer(checkpoints, family):
    """The whole CPU pipeline on a tiny DeepSeek checkpoint (2 layers): one fused op a layer, and the
    logits still the eager model's."""
    from models.loader import load_model

    model = load_model(checkpoints[family], torch.float32, "cpu")
    ids, positions = torch.randint(0, 300, (9,)), torch.arange(9)
    with torch.no_grad():
        ref = model.compute_logits(model(ids, positions))
    pm, reports = PassManager.for_platform("cpu"), []

    def backend(gm, example_inputs):
        reports[:] = pm.run(gm)
        return gm

    compiled = torch.compile(model.forward, backend=backend, fullgraph=True, dynamic=True)
    with torch.no_grad():
        got = model.compute_logits(compiled(ids, positions))
    by_name = {r.name: (r.matched, r.rewritten) for r in reports}
    layers = model.arch.num_layers
    assert by_name["fuse_mla_latent_norm_rope"] == (layers, layers)
    code = reports[-1].graph_after
    assert code.count("torch.ops.atomc.mla_latent_norm_rope.default(") == layers
    assert "torch.ops.atomc.rope.default(" not in code and "torch.cat(" not in code  # gathers folded in
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
