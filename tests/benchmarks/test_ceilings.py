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


def test_fp8_serving_ceiling_counts_the_servers_bytes():
    # --quantization fp8: the decoder linears at a byte a value (+ fp32 row scales), lm_head bf16;
    # --kv-cache-dtype fp8: a byte a KV value
    bf16 = ceilings.decode_step_s("llama-3.1-8b", 64, 1024, 1024, BW)
    fp8 = ceilings.decode_step_s("llama-3.1-8b", 64, 1024, 1024, BW, weights="fp8")
    fp8kv = ceilings.decode_step_s("llama-3.1-8b", 64, 1024, 1024, BW, weights="fp8", kv_dtype_bytes=1)
    linear_bf16 = 2 * 32 * (4096 * 128 * 48 + 4096 * 4096 + 3 * 4096 * 14336)
    assert (bf16 - fp8) * BW == pytest.approx(linear_bf16 / 2 - 4 * 32 * (6144 + 4096 + 28672 + 4096))
    assert (fp8 - fp8kv) * BW == pytest.approx(64 * 1536 * 131072 / 2)
    cells = [ceilings.serving_bounds("llama-3.1-8b", 64, 1024, 1024, BW, FLOPS, w, kv) for w, kv in
             (("bf16", 2), ("fp8", 2), ("fp8", 1))]  # fmt: skip
    assert cells[0]["ceiling_tok_s"] < cells[1]["ceiling_tok_s"] < cells[2]["ceiling_tok_s"]
    with pytest.raises(ValueError, match="int4"):
        ceilings.serving_bounds("llama-3.1-8b", 64, 1024, 1024, BW, FLOPS, "int4")


def test_serving_reads_the_formats_from_the_server_flags():
    import serving

    assert serving.server_formats("") == ("bf16", 2)
    assert serving.server_formats("--quantization fp8") == ("fp8", 2)
    assert serving.server_formats("--quantization=fp8 --kv-cache-dtype fp8_e4m3") == ("fp8", 1)
    assert serving.server_formats("--kv-cache-dtype auto") == ("bf16", 2)
    # a checkpoint published quantised is counted in its format (GPT-OSS's MXFP4 experts)
    assert serving.server_formats("", serving.CONFIGS["gpt-oss-20b-mxfp4"]) == ("mxfp4", 2)
    assert serving.server_formats("", serving.CONFIGS["gpt-oss-20b"]) == ("bf16", 2)


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


@pytest.mark.parametrize("name", MOE + ("deepseek-v3-layers",))
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
    # DeepSeek-V3's correction bias is a buffer there (a parameter in atomc, read every step)
    total += sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
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
    # bf16 as every engine runs it, but the one variant kept in its published format
    assert ("quantization_config" in real) == name.endswith("-mxfp4")


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


# --- DeepSeek (latent attention) -------------------------------------------------------------------


def test_tiny_deepseek_v2_lite_by_hand():
    # hidden 64, 4 heads, no q LoRA, latent 32 + rope 8, nope 16, v 16; 1 dense layer (MLP 96) and 1
    # sparse one (top 2 of 8 experts of 32, 2 shared experts of 32 = one MLP of 64); vocab 512
    cfg = checkpoints.tiny_config("deepseek-v2-lite")
    s = ceilings.moe_shape(cfg)
    assert (s.layers, s.sparse_layers, s.dense_layers, s.experts, s.top_k) == (2, 1, 1, 8, 2)
    q = 64 * 4 * (16 + 8)  # q_proj
    kv = 64 * (32 + 8) + 32 + 32 * 4 * (16 + 16)  # kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj
    o = 4 * 16 * 64
    assert s.attn_params() == q + kv + o == 16928
    layers = 2 * (16928 + 2 * 64)  # attention and the two norms of each layer
    sparse = 8 * 64 + 3 * 64 * 64  # router, the shared experts
    dense = 3 * 64 * 96
    head = 512 * 64 + 64  # lm_head and the final norm
    assert s.nonexpert_params() == layers + sparse + dense + head == 98176
    assert s.expert_params() == 3 * 64 * 32 == 6144
    # batch 1: the non-expert weights + 2 experts, bf16; the latent cache: 2 layers x 40 values x 2 B
    assert ceilings.moe_active_bytes(cfg) == 2 * (98176 + 2 * 6144) == 220928
    assert ceilings.moe_kv_bytes(cfg, 1) == 160 and ceilings.moe_kv_bytes(cfg, 100) == 16000
    assert ceilings.moe_active_bytes(cfg, 100) == 220928 + 16000
    assert ceilings.moe_bs1_roofline(cfg, 16, 24, 20e9) == pytest.approx(20e9 / (220928 + 28 * 160))
    # CONC 4 at context 28: D(4) = 8 (1 - (3/4)^4) experts, 4 sequences' latents
    d4 = 8 * (1 - 0.75**4)
    assert ceilings.moe_step_bytes(cfg, 4, 28) == pytest.approx(2 * (98176 + d4 * 6144) + 4 * 28 * 160)
    # prefill of 16 tokens: 2 x the weights a token passes (both attentions, the router, the shared
    # experts, 2 experts, the dense MLP) + expanded attention, 2 x 4 heads x (24 + 16) FLOPs a key,
    # 16^2 / 2 causal keys in each of the 2 layers
    per_token = 2 * 16928 + (512 + 3 * 64 * 64 + 2 * 6144) + 3 * 64 * 96
    assert ceilings.moe_prefill_flops(cfg, 16) == 2 * per_token * 16 + 2 * 4 * 40 * 2 * 16**2 / 2 == 2557952


def test_tiny_deepseek_v3_layers_by_hand():
    # V3-style: q through a LoRA of 24 (with its norm), one shared expert, the correction bias
    cfg = checkpoints.tiny_config("deepseek-v3-layers")
    s = ceilings.moe_shape(cfg)
    assert s.mla.q_lora == 24 and s.router_bias and s.shared_inter == 32
    q = 64 * 24 + 24 + 24 * 4 * 24
    assert s.attn_params() == q + 6688 + 4096 == 14648
    nonexpert = 2 * (14648 + 128) + (8 * 64 + 8) + 3 * 64 * 32 + 3 * 64 * 96 + 512 * 64 + 64
    assert s.nonexpert_params() == nonexpert == 87480
    assert ceilings.moe_active_bytes(cfg, 10) == 2 * (87480 + 2 * 6144) + 10 * 160


def test_deepseek_v2_lite_published_figures():
    # 15.7 B parameters, 2.4 B active a token (DeepSeek's figures); 27 layers x 576 latent values x 2 B
    s = ceilings.moe_shape("deepseek-v2-lite")
    total = s.nonexpert_params() + s.sparse_layers * s.experts * s.expert_params() + s.vocab * s.hidden
    assert total == pytest.approx(15.7e9, rel=0.005)
    assert ceilings.moe_active_bytes("deepseek-v2-lite") / 2 == pytest.approx(2.45e9, rel=0.005)
    assert ceilings.moe_kv_bytes("deepseek-v2-lite", 1) == 27 * 576 * 2 == 31104
    # not the 2 x 16 heads x 192 values transformers' expanded K/V would take
    assert ceilings.moe_kv_bytes("deepseek-v2-lite", 1) < 27 * 2 * 16 * 192 * 2 / 10
    bounds = ceilings.serving_bounds("deepseek-v2-lite", 64, 1024, 1024, BW, FLOPS)
    assert bounds["kv_bytes_per_token"] == 31104 and bounds["experts"] == 64 and bounds["top_k"] == 6


def test_deepseek_v3_layers_default_fits_an_h200():
    # 3 dense + 4 MoE layers: 99.3 GB of bf16 weights; one more MoE layer would need 122 GB
    def weights(cfg):
        s = ceilings.moe_shape(cfg)
        return 2 * (s.nonexpert_params() + s.sparse_layers * s.experts * s.expert_params() + s.vocab * s.hidden)

    cfg = checkpoints.CONFIGS["deepseek-v3-layers"]
    assert (cfg["num_hidden_layers"], cfg["first_k_dense_replace"]) == (7, 3)
    assert weights(cfg) == pytest.approx(99.27e9, rel=1e-3) and weights(checkpoints.deepseek_v3_layers(5)) > 120e9
    # a V3 layer's attention: the matmuls q_a 7168 x 1536, q_b 1536 x 128 x 192, kv_a 7168 x 576,
    # kv_b 512 x 128 x 256, o 128 x 128 x 7168 (187,105,280), and the two LoRA norms
    s = ceilings.moe_shape(cfg)
    matmuls = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    assert s.attn_params() == matmuls + 1536 + 512 and matmuls == 187_105_280
    assert ceilings.moe_kv_bytes(cfg, 1) == 7 * 576 * 2
    with pytest.raises(ValueError, match="at least one layer"):
        checkpoints.deepseek_v3_layers(0, 0)


def test_deepseek_other_moe_layer_freq_is_refused():
    with pytest.raises(ValueError, match="moe_layer_freq"):
        ceilings.moe_shape(dict(checkpoints.CONFIGS["deepseek-v2-lite"], moe_layer_freq=2))


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v3-layers", "qwen3-30b-a3b"])
def test_layer_bytes_add_up_to_the_step(name):
    s = ceilings.moe_shape(name)
    for conc, context in ((1, 0), (64, 1100)):
        part = ceilings.moe_layer_bytes(name, conc, context)
        total = s.dense_layers * part["dense"] + s.sparse_layers * part["sparse"] + part["rest"]
        assert total == pytest.approx(ceilings.moe_step_bytes(name, conc, context), rel=1e-12)
    # V3's sparse layer at batch 1: attention + norms + router and bias + 1 shared + 8 routed experts
    v3 = ceilings.moe_layer_bytes("deepseek-v3-layers", 1, 0)
    expert = 3 * 7168 * 2048
    assert v3["sparse"] == 2 * (187_107_328 + 2 * 7168 + 256 * 7168 + 256 + 9 * expert)
    assert v3["dense"] == 2 * (187_107_328 + 2 * 7168 + 3 * 7168 * 18432) and v3["rest"] == 2 * (129280 + 1) * 7168


def test_fp8_moe_bytes_count_a_byte_a_weight_plus_row_scales():
    # Mixtral-8x7B by hand: per layer q/k/v/o (4096 x 128 x 48 + 4096 x 4096) and 2 experts
    # (3 x 4096 x 14336) in FP8 with an fp32 scale a row; router, norms, lm_head (32000 x 4096) bf16
    attn, attn_rows = 4096 * 128 * 48 + 4096 * 4096, 128 * 48 + 4096
    expert, expert_rows = 3 * 4096 * 14336, 2 * 14336 + 4096
    layer = attn + 4 * attn_rows + 2 * (expert + 4 * expert_rows) + 2 * (8 * 4096 + 2 * 4096)
    want = 32 * layer + 2 * (32000 * 4096 + 4096)
    assert ceilings.moe_active_bytes("mixtral-8x7b", weights="fp8") == pytest.approx(want, rel=1e-12)
    # about half the bf16 bytes: the lm_head (and Qwen3's 152k-row one more so) stays bf16
    for name, ratio in (("mixtral-8x7b", 1.98), ("qwen3-30b-a3b", 1.80)):
        bf16, fp8 = (ceilings.moe_active_bytes(name, weights=w) for w in ("bf16", "fp8"))
        assert bf16 / fp8 == pytest.approx(ratio, abs=0.01)
    assert ceilings.moe_bs1_roofline("mixtral-8x7b", 128, 512, 4.23e12, "fp8") == pytest.approx(
        4.23e12 / (want + 384 * 131072), rel=1e-9
    )  # the KV stays bf16
    with pytest.raises(ValueError, match="weights 'int4' is not one of"):
        ceilings.moe_active_bytes("mixtral-8x7b", weights="int4")
    with pytest.raises(ValueError, match="FP8 bytes of latent-attention models are not counted"):
        ceilings.moe_active_bytes("deepseek-v2-lite", weights="fp8")


def held_bytes(model, expert_share: float) -> dict[str, float]:
    """The bytes a decode step reads of what atomc holds, per decoder layer (`model.layers.N`) and
    the rest: every parameter, the routed experts at `expert_share` (top_k of E), the embedding
    table left out (a step reads one row). Shared experts the MoE op holds (its last rows) are read
    whole, as a shared MLP beside it is."""
    shared = {f"{n}.": m.num_shared for n, m in model.named_modules() if getattr(m, "num_shared", 0)}
    out: dict[str, float] = {}
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            continue
        part = ".".join(name.split(".")[:3]) if name.startswith("model.layers.") else "rest"
        size = p.numel() * p.element_size()
        if ".experts." in name:
            rows, s = p.shape[0], next((v for k, v in shared.items() if name.startswith(k)), 0)
            size *= ((rows - s) * expert_share + s) / rows
        out[part] = out.get(part, 0.0) + size
    return out


def test_fp8_moe_bytes_are_what_atomc_loads(tmp_path):
    """The tiny Qwen3-MoE under --quantization fp8, as atomc holds it: every parameter's bytes (the
    embedding table left out, the experts at top_k of E) are the FP8 bytes the roofline counts."""
    import checkpoints
    import torch

    from models.loader import load_model

    folder = checkpoints.make_checkpoint("qwen3-30b-a3b", tmp_path, tiny=True)
    cfg = checkpoints.model_config("qwen3-30b-a3b", tiny=True)
    model = load_model(folder, torch.bfloat16, "cpu", load_format="dummy", quantization="fp8")
    total = sum(held_bytes(model, cfg["num_experts_per_tok"] / cfg["num_experts"]).values())
    assert model.model.layers[0].mlp.experts.w13_weight.dtype == torch.float8_e4m3fn
    assert ceilings.moe_active_bytes(cfg, weights="fp8") == pytest.approx(total, rel=1e-9)


def test_mxfp4_moe_bytes_are_what_atomc_loads(tmp_path):
    """The tiny GPT-OSS with its published MXFP4 quantization_config, as atomc holds it: every
    parameter's bytes (the embedding table left out, the experts at top_k of E) are the bytes the
    MXFP4 roofline counts; the full-size model reads about half its bf16 bytes a token."""
    import checkpoints
    import torch

    from models.loader import load_model

    folder = checkpoints.make_checkpoint("gpt-oss-20b-mxfp4", tmp_path, tiny=True)
    cfg = checkpoints.model_config("gpt-oss-20b-mxfp4", tiny=True)
    model = load_model(folder, torch.bfloat16, "cpu", load_format="dummy")
    total = sum(held_bytes(model, cfg["num_experts_per_tok"] / cfg["num_local_experts"]).values())
    assert model.model.layers[0].mlp.experts.w13_blocks.dtype == torch.uint8
    assert ceilings.moe_active_bytes(cfg, weights="mxfp4") == pytest.approx(total, rel=1e-9)
    bf16, mxfp4 = (ceilings.moe_active_bytes("gpt-oss-20b-mxfp4", weights=w) for w in ("bf16", "mxfp4"))
    assert bf16 / mxfp4 == pytest.approx(1.94, abs=0.01)
    with pytest.raises(ValueError, match="no experts"):
        ceilings.dense_weight_bytes("llama-3.1-8b", weights="mxfp4")


def test_fp8_block_layer_bytes_are_what_atomc_loads(tmp_path):
    """DeepSeek-V3's published block-FP8 config at toy widths (one dense, one MoE layer), as atomc
    holds it: each layer's parameters are the bytes `moe_layer_bytes(weights="fp8_block")` counts
    (routed experts at top_k of E); at full width a layer reads about half its bf16 bytes."""
    import checkpoints
    import torch

    from models.loader import load_model

    cfg = checkpoints.tiny_config(checkpoints.deepseek_v3_layers(1, 1, fp8=True))
    folder = checkpoints.write_checkpoint(cfg, tmp_path / "v3fp8")
    model = load_model(folder, torch.bfloat16, "cpu", load_format="dummy")
    layers = held_bytes(model, cfg["num_experts_per_tok"] / cfg["n_routed_experts"])
    held = [layers["model.layers.0"], layers["model.layers.1"]]
    assert model.model.layers[1].mlp.experts.w13_weight.dtype == torch.float8_e4m3fn
    part = ceilings.moe_layer_bytes(cfg, 1, 0, weights="fp8_block")
    assert (part["dense"], part["sparse"]) == (pytest.approx(held[0], rel=1e-9), pytest.approx(held[1], rel=1e-9))
    full = checkpoints.deepseek_v3_layers(1, 1, fp8=True)
    bf16, fp8 = (ceilings.moe_layer_bytes(full, 1, 0, weights=w) for w in ("bf16", "fp8_block"))
    assert 1.8 < bf16["sparse"] / fp8["sparse"] < 2.0 and 1.8 < bf16["dense"] / fp8["dense"] < 2.0
