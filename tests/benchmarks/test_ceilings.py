"""The ceilings the benchmarks report against (benchmarks/ceilings.py): pure arithmetic, no GPU."""

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import ceilings  # noqa: E402
import checkpoints  # noqa: E402

BW, FLOPS = 4.3e12, 790e12  # the rates docs/performance.md's targets were set with


def test_llama_serving_ceiling_matches_the_targets_figure():
    # the targets' 8,290 tok/s also counts logits for every prompt token (+0.5 GFLOP a token);
    # engines compute them for the last token only, so the ceiling here is about 1% higher
    got = ceilings.serving_ceiling("llama-3.1-8b", 64, 1024, 1024, BW, FLOPS)
    assert got == pytest.approx(8290, rel=0.015)
    assert got > 8290


def test_prefill_lowers_the_decode_only_bound():
    for name in ("llama-3.1-8b", "qwen3-8b"):
        bound = ceilings.decode_only_bound(name, 64, 1024, 1024, BW)
        ceiling = ceilings.serving_ceiling(name, 64, 1024, 1024, BW, FLOPS)
        assert 0.8 * bound < ceiling < bound
        # infinitely fast prefill leaves the decode-only bound
        assert ceilings.serving_ceiling(name, 64, 1024, 1024, BW, 1e30) == pytest.approx(bound)


def test_llama_decode_step_at_conc_64():
    # 15.0 GB of weights + 64 sequences x 1,536 tokens x 131,072 B of KV, at 4.3 TB/s
    assert ceilings.kv_bytes_per_token("llama-3.1-8b") == 131072
    assert ceilings.decode_step_s("llama-3.1-8b", 64, 1024, 1024, BW) == pytest.approx(6.49e-3, rel=0.01)


# --- mixtures of experts ---------------------------------------------------------------------------

MOE = checkpoints.MOE_MODELS


def test_distinct_experts_formula_against_sampled_routing():
    # the derivation's model: each of c tokens picks k distinct experts of E uniformly at random
    rng = random.Random(0)
    for experts, top_k, conc in [(128, 8, 1), (128, 8, 8), (128, 8, 64), (8, 2, 3), (32, 4, 16)]:
        trials = 400
        seen = sum(len(set().union(*(rng.sample(range(experts), top_k) for _ in range(conc)))) for _ in range(trials))
        assert seen / trials == pytest.approx(ceilings.expected_distinct_experts(experts, top_k, conc), rel=0.02)


def test_distinct_experts_limits():
    assert ceilings.expected_distinct_experts(128, 8, 1) == pytest.approx(8)
    assert ceilings.expected_distinct_experts(128, 8, 64) == pytest.approx(125.94, abs=0.01)
    assert ceilings.expected_distinct_experts(8, 8, 2) == 8  # every expert chosen by every token
    d = [ceilings.expected_distinct_experts(128, 8, c) for c in (1, 8, 32, 64, 128)]
    assert d == sorted(d) and d[-1] < 128


def test_active_roofline_matches_the_issues_figures():
    # Mixtral-8x7B: 25.5 GB of active weights a token, 166 tok/s at 4.23 TB/s; Qwen3-30B-A3B: ~695 tok/s
    assert ceilings.moe_active_bytes("mixtral-8x7b") == pytest.approx(25.5e9, rel=0.002)
    assert 4.23e12 / ceilings.moe_active_bytes("mixtral-8x7b") == pytest.approx(166, abs=0.5)
    assert 4.23e12 / ceilings.moe_active_bytes("qwen3-30b-a3b") == pytest.approx(695, abs=1)
    # the KV at mid-output lowers the roofline a little: 384 tokens x 128 KiB for Mixtral
    with_kv = ceilings.moe_bs1_roofline("mixtral-8x7b", 128, 512, 4.23e12)
    assert with_kv == pytest.approx(4.23e12 / (25.4977e9 + 384 * 131072), rel=1e-4)


@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("tiny", [False, True])
def test_parameter_count_matches_transformers(name, tiny):
    # the shape's parameter counts, summed over every expert, are the model transformers builds
    import torch
    import transformers

    cfg_dict = checkpoints.model_config(name, tiny)
    fields = {k: v for k, v in cfg_dict.items() if k != "model_type"}
    cfg = transformers.AutoConfig.for_model(cfg_dict["model_type"], **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    total = sum(p.numel() for p in model.parameters())
    s = ceilings.moe_shape(cfg_dict)
    embed = s.vocab * s.hidden  # the embedding table (a step reads one row of it)
    assert total == s.nonexpert_params() + s.sparse_layers * s.experts * s.expert_params() + embed


def test_qwen3_dense_layers_and_gpt_oss_window():
    cfg = dict(checkpoints.CONFIGS["qwen3-30b-a3b"], mlp_only_layers=[0, 1])
    s = ceilings.moe_shape(cfg)
    assert (s.sparse_layers, s.dense_layers) == (46, 2)
    assert ceilings.moe_shape(dict(cfg, mlp_only_layers=[], decoder_sparse_step=2)).sparse_layers == 24
    g = ceilings.moe_shape("gpt-oss-20b")
    assert (g.sliding_layers, g.window, g.attn_bias, g.expert_bias) == (12, 128, True, True)
    per = 2 * 8 * 64 * 2  # K and V, 8 heads of 64, bf16, one layer and token
    assert ceilings.moe_kv_bytes("gpt-oss-20b", 1536) == per * (12 * 1536 + 12 * 128)
    assert ceilings.moe_kv_bytes("gpt-oss-20b", 100) == per * 24 * 100


def test_moe_decode_step_reads_distinct_experts():
    s = ceilings.moe_shape("qwen3-30b-a3b")
    step64 = ceilings.moe_step_bytes("qwen3-30b-a3b", 64, 1536)
    expect = 2 * (s.nonexpert_params() + 48 * 125.9423 * s.expert_params()) + 64 * 1536 * 98304
    assert step64 == pytest.approx(expect, rel=1e-5)
    # never more than the whole model plus KV
    whole = 2 * (s.nonexpert_params() + 48 * 128 * s.expert_params())
    assert ceilings.moe_step_bytes("qwen3-30b-a3b", 4096, 0) == pytest.approx(whole)


def test_moe_prefill_flops_by_hand():
    s = ceilings.moe_shape("mixtral-8x7b")
    isl = 1024
    per_layer = 4096 * 128 * 48 + 4096 * 4096 + 8 * 4096 + 2 * 3 * 4096 * 14336
    assert ceilings.moe_prefill_flops("mixtral-8x7b", isl) == pytest.approx(
        2 * 32 * per_layer * isl + 2 * isl**2 * 32 * 128 * 32
    )
    # a window shorter than the prompt cuts the sliding layers' attention, not the matmuls
    g = checkpoints.CONFIGS["gpt-oss-20b"]
    no_window = dict(g, layer_types=["full_attention"] * 24)
    assert ceilings.moe_prefill_flops(g, 64) == pytest.approx(ceilings.moe_prefill_flops(no_window, 64))
    assert ceilings.moe_prefill_flops(g, 1024) < ceilings.moe_prefill_flops(no_window, 1024)
    assert s.expert_params() == 3 * 4096 * 14336


@pytest.mark.parametrize("name", MOE)
def test_moe_serving_ceiling_below_decode_only_bound(name):
    for conc in (1, 8, 64, 128):
        bound = ceilings.moe_decode_only_bound(name, conc, 1024, 1024, BW)
        ceiling = ceilings.moe_serving_ceiling(name, conc, 1024, 1024, BW, FLOPS)
        assert ceiling < bound
        assert ceilings.moe_serving_ceiling(name, conc, 1024, 1024, BW, 1e30) == pytest.approx(bound)
    # more sequences per step share the experts read: the bound per sequence falls, the total rises
    totals = [ceilings.moe_decode_only_bound(name, c, 1024, 1024, BW) for c in (1, 8, 32, 64, 128)]
    assert totals == sorted(totals)


def test_dense_models_are_not_moe():
    assert not ceilings.is_moe("llama-3.1-8b") and ceilings.is_moe("gpt-oss-20b")
    with pytest.raises(ValueError, match="not a mixture of experts"):
        ceilings.moe_shape("qwen3-8b")


@pytest.mark.parametrize("name", MOE)
def test_tiny_config_keeps_the_family(name):
    real, tiny = checkpoints.CONFIGS[name], checkpoints.tiny_config(name)
    assert tiny["architectures"] == real["architectures"] and set(real) <= set(tiny) | {"head_dim"}
    s = ceilings.moe_shape(tiny)
    assert s.layers == 2 and s.hidden == 64 and 1 <= s.top_k < s.experts <= 8
    assert "quantization_config" not in real


def test_serving_bounds_picks_the_definition():
    dense = ceilings.serving_bounds("llama-3.1-8b", 64, 1024, 1024, BW, FLOPS)
    assert dense == {
        "ceiling_tok_s": ceilings.serving_ceiling("llama-3.1-8b", 64, 1024, 1024, BW, FLOPS),
        "decode_bound_tok_s": ceilings.decode_only_bound("llama-3.1-8b", 64, 1024, 1024, BW),
    }
    moe = ceilings.serving_bounds("qwen3-30b-a3b", 64, 1024, 1024, BW, FLOPS)
    assert moe["ceiling_tok_s"] == ceilings.moe_serving_ceiling("qwen3-30b-a3b", 64, 1024, 1024, BW, FLOPS)
    assert moe["distinct_experts_per_layer"] == pytest.approx(125.94, abs=0.01)


# --- MLA decode attention --------------------------------------------------------------------------


def test_mla_decode_roofline_at_v3_widths():
    # bs 64 x 4k at 128 heads, kv_lora 512, rope 64: 302 MB of latent, 2 x (576 + 512) FLOPs a
    # head and key; 242 FLOP/B against an H200's ridge of 989 / 4.3 = 230: compute-bound
    r = ceilings.mla_decode_roofline(64, 4096, 128, 512, 64, BW, 989.4e12)
    assert r["latent_bytes"] == 64 * 4096 * 576 * 2
    assert r["flops"] == 64 * 4096 * 128 * 2 * (576 + 512)
    assert r["intensity"] == pytest.approx(1.889 * 128, rel=1e-3) and r["ridge"] == pytest.approx(230.1, rel=1e-3)
    assert r["bound"] == "compute" and r["bound_s"] == r["compute_s"] == pytest.approx(73.8e-6, rel=1e-3)
    # 70% of HBM bandwidth at this intensity is ~728 TFLOP/s, 74% of the bf16 peak
    assert 0.7 * BW * r["intensity"] == pytest.approx(728e12, rel=1e-3)
    # the intensity does not depend on batch or context; 16 heads (V2-Lite) are memory-bound
    assert ceilings.mla_decode_roofline(8, 16384, 128, 512, 64, BW, 989.4e12)["intensity"] == r["intensity"]
    lite = ceilings.mla_decode_roofline(8, 4096, 16, 512, 64, BW, 989.4e12)
    assert lite["bound"] == "memory" and lite["bound_s"] == lite["memory_s"]


def test_dense_bf16_peak_lookup():
    assert ceilings.dense_bf16_peak("NVIDIA H200") == 989.4e12
    assert ceilings.dense_bf16_peak("Some GPU") is None
