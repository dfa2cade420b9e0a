"""DeepSeek-V2/V3 (models/deepseek.py) and its latent attention (atomc::mla_attention), fp32 on the CPU.

The shared family tests run both tiny checkpoints (tests/conftest.py: deepseek_v2, deepseek_v3)
against transformers: prompt logits (tests/models/test_families.py), 32 eager greedy tokens, and
the compiled engine against the eager one (tests/graphs/test_engine.py). Here: the op's absorbed
form against the expanded per-head attention it replaces, with and without a paged cache; the
latent cache's allocation and size; the routing and YaRN details that must take effect; prefix
hits and chunked prefill over the latent cache; the configs atomc refuses.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from atomc import LLM, SamplingParams
from atomc.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from atomc.kv_spec import MLAAttentionSpec, kv_cache_groups
from atomc.ops.mla import write_latent_cache
from atomc.ops.moe import select_experts
from atomc.runtime.kv_cache import allocate_kv_cache, bytes_per_block
from models.arch import ModelArch
from models.deepseek import DeepseekMoE, MLAAttention
from models.layers.mlp import GatedMLP
from models.loader import load_model
from tests.conftest import FAMILIES

H, NOPE, ROPE, LORA, V = 4, 16, 8, 32, 16


def expanded_attention(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale, q_offset):
    """The form transformers computes, in float64: per-head K = [c_kv W_UK^T | k_pe], V = c_kv W_UV^T,
    queries at positions q_offset.. over keys 0.., causal. -> [Lq, H, v]."""
    d = torch.float64
    k_nope = torch.einsum("kl,hnl->khn", c_kv.to(d), w_uk.to(d))
    values = torch.einsum("kl,hvl->khv", c_kv.to(d), w_uv.to(d))
    scores = torch.einsum("qhn,khn->hqk", q_nope.to(d), k_nope) + torch.einsum("qhr,kr->hqk", q_pe.to(d), k_pe.to(d))
    q_pos = torch.arange(q_offset, q_offset + q_nope.shape[0])[:, None]
    scores = (scores * scale).masked_fill(torch.arange(c_kv.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khv->qhv", scores.softmax(-1), values)


def random_mla(tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(tokens, H, NOPE, generator=g),
        torch.randn(tokens, H, ROPE, generator=g),
        torch.randn(tokens, LORA, generator=g),
        torch.randn(tokens, ROPE, generator=g),
    )


def run_op(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale, layer=0):
    q_absorbed = torch.einsum("thn,hnl->thl", q_nope, w_uk)
    out = torch.empty(q_nope.shape[0], H, LORA)
    torch.ops.atomc.mla_attention(q_absorbed, q_pe, c_kv, k_pe, out, layer, scale)
    return torch.einsum("thl,hvl->thv", out, w_uv)


@pytest.fixture
def weights():
    g = torch.Generator().manual_seed(7)
    return torch.randn(H, NOPE, LORA, generator=g) / 4, torch.randn(H, V, LORA, generator=g) / 4


def test_absorbed_equals_expanded_without_a_cache(weights):
    w_uk, w_uv = weights
    q_nope, q_pe, c_kv, k_pe = random_mla(11, 0)
    got = run_op(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, 0.2)
    want = expanded_attention(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, 0.2, 0)
    assert (got.double() - want).abs().max().item() < 1e-5


def test_absorbed_equals_expanded_over_the_paged_latent_cache(weights):
    """One batch: a chunk over a cached prefix, a decode row, a fresh prompt; pages of 4 tokens,
    scattered over the pool; padding rows (slot -1) write nothing."""
    w_uk, w_uv = weights
    block, scale = 4, 0.3
    spec = MLAAttentionSpec(LORA, ROPE)
    ((latent, values),) = allocate_kv_cache([spec], 16, block, torch.float32, "cpu", lambda s: "NHD")
    seqs = [(5, 3), (8, 1), (0, 6)]  # (cached prefix, new tokens)
    tables = [[9, 2, 14], [3, 11, 7], [0, 5, 12]]
    data = [random_mla(p + n, 10 + i) for i, (p, n) in enumerate(seqs)]

    def slots(i, positions):
        return [tables[i][p // block] * block + p % block for p in positions]

    for i, (p, _) in enumerate(seqs):  # the prefixes, as earlier steps left them
        if p:
            _, _, c_kv, k_pe = data[i]
            rows = torch.cat([c_kv[:p], k_pe[:p]], -1).unsqueeze(1)
            write_latent_cache(rows, latent, torch.tensor(slots(i, range(p))))
    new = [torch.cat([x[p:] for x, (p, _) in zip(parts, seqs, strict=True)]) for parts in zip(*data, strict=True)]
    pad = 2  # trailing padding rows, as a CUDA-graph batch has
    new = [torch.cat([t, torch.zeros(pad, *t.shape[1:])]) for t in new]
    slot_mapping = sum((slots(i, range(p, p + n)) for i, (p, n) in enumerate(seqs)), []) + [-1] * pad
    starts = [0, 3, 4, 10]
    lens = [p + n for p, n in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        query_start_loc_host=starts,
        seq_lens_host=lens,
        max_query_len=6,
        max_seq_len=9,
        num_seqs=3,
    )
    before = latent.clone()
    with set_forward_context(ForwardContext(meta, [(latent, values)])):
        got = run_op(*new, w_uk, w_uv, scale)
    for i, (p, _) in enumerate(seqs):
        want = expanded_attention(*data[i][:2], *data[i][2:], w_uk, w_uv, scale, 0)[p:]
        assert (got[starts[i] : starts[i + 1]].double() - want).abs().max().item() < 1e-5
    written = (latent != before).any(-1).flatten().nonzero().flatten().tolist()
    assert sorted(written) == sorted(s for s in slot_mapping if s >= 0)  # padding wrote nothing


def test_the_latent_cache_holds_one_vector_a_token():
    """V3's widths: 512 + 64 values a token and layer, not per-head K and V; V is a view of K's pages."""
    spec = MLAAttentionSpec(kv_lora_rank=512, qk_rope_head_dim=64)
    assert spec.bytes_per_token(torch.bfloat16) == 576 * 2
    assert bytes_per_block([spec] * 3, 16, torch.bfloat16) == 3 * 16 * 576 * 2
    assert kv_cache_groups([spec] * 3)[0].layers == (0, 1, 2)
    caches = allocate_kv_cache([spec] * 2, 5, 16, torch.bfloat16, "cpu", lambda s: "NHD")
    for k, v in caches:
        assert k.shape == (5, 16, 1, 576) and v.shape == (5, 16, 1, 512)
        assert v.data_ptr() == k.data_ptr() and v.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    assert caches[0][0].untyped_storage().nbytes() == 2 * 5 * 16 * 576 * 2  # both layers, nothing more


def shared_width(moe: DeepseekMoE) -> int:
    """The shared experts' intermediate size: a GatedMLP's, or the experts the MoE op holds."""
    if moe.shared_experts is not None:
        return moe.shared_experts.inter
    return moe.experts.spec.shared_experts * moe.experts.spec.intermediate_size


@pytest.fixture(scope="module")
def hf_v3(checkpoints):
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoints["deepseek_v3"], dtype=torch.float32).eval()


def test_v3_layers_routing_and_scale_follow_the_config(checkpoints, hf_v3):
    model = load_model(checkpoints["deepseek_v3"], torch.float32, "cpu")
    mlps = [layer.mlp for layer in model.model.layers]
    assert isinstance(mlps[0], GatedMLP) and all(isinstance(m, DeepseekMoE) for m in mlps[1:])
    spec = mlps[1].experts.spec
    assert (spec.scoring, spec.num_expert_group, spec.topk_group, spec.renormalize) == ("sigmoid", 4, 2, True)
    assert spec.routed_scaling_factor == 2.5
    assert shared_width(mlps[1]) == 32  # moe_intermediate_size x 1 shared expert
    attn = model.model.layers[0].self_attn
    assert isinstance(attn, MLAAttention)
    assert attn.c.softmax_scale == pytest.approx(hf_v3.model.layers[0].self_attn.scaling, rel=1e-12)
    assert attn.c.softmax_scale != pytest.approx(24**-0.5)  # YaRN's mscale_all_dim changed it
    assert model.kv_cache_specs() == [MLAAttentionSpec(32, 8)] * 3


def test_v3_correction_bias_changes_the_chosen_experts(checkpoints):
    """The checkpoint's random e_score_correction_bias is large enough to move choices: without it
    the same router logits pick other experts for some tokens (so the logits tests cover it)."""
    model = load_model(checkpoints["deepseek_v3"], torch.float32, "cpu")
    moe = model.model.layers[1].mlp
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    logits = moe.gate(x)
    s = moe.experts.spec
    args = (s.top_k, s.scoring, s.renormalize)
    _, with_bias = select_experts(logits, *args, moe.gate.e_score_correction_bias, 4, 2, 2.5)
    _, without = select_experts(logits, *args, None, 4, 2, 2.5)
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    assert (with_bias.sort(-1).values != without.sort(-1).values).any(-1).sum() > 4


def test_v2_has_no_q_lora_and_plain_softmax_routing(checkpoints):
    model = load_model(checkpoints["deepseek_v2"], torch.float32, "cpu")
    attn, moe = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert not hasattr(attn, "q_a_layernorm") and attn.qkv_a_proj.output_sizes == [H * (NOPE + ROPE), LORA + ROPE]
    s = moe.experts.spec
    assert (s.scoring, s.renormalize, s.num_expert_group, s.routed_scaling_factor) == ("softmax", False, 0, 1.5)
    assert moe.gate.e_score_correction_bias is None and shared_width(moe) == 64


# (family, the checkpoint's q projection of x, its rows): V2 without q LoRA, V3 with q_lora_rank 24
Q_OF_X = {"deepseek_v2": ("q_proj", H * (NOPE + ROPE)), "deepseek_v3": ("q_a_proj", 24)}


@pytest.mark.parametrize("family", list(Q_OF_X))
def test_q_and_kv_a_projections_load_into_one_linear(family, checkpoints):
    """q_a_proj (V3) or q_proj (V2) and kv_a_proj_with_mqa become qkv_a_proj, q's rows first, each
    section the checkpoint's tensor; the layer's x feeds one GEMM; the way back names both tensors."""
    from safetensors.torch import load_file

    from models.layers.linear import MergedColumnParallelLinear
    from models.loader.safetensors import checkpoint_shapes

    q_name, q_rows = Q_OF_X[family]
    ckpt = load_file(str(checkpoints[family] / "model.safetensors"))
    model = load_model(checkpoints[family], torch.float32, "cpu")
    for i, layer in enumerate(model.model.layers):
        attn, pre = layer.self_attn, f"model.layers.{i}.self_attn."
        assert isinstance(attn.qkv_a_proj, MergedColumnParallelLinear)
        assert not any(hasattr(attn, n) for n in ("q_proj", "q_a_proj", "kv_a_proj_with_mqa"))
        assert attn.qkv_a_proj.output_sizes == [q_rows, LORA + ROPE]
        want = torch.cat([ckpt[pre + f"{q_name}.weight"], ckpt[pre + "kv_a_proj_with_mqa.weight"]])
        assert torch.equal(attn.qkv_a_proj.weight, want)
    shapes = checkpoint_shapes(model)  # what benchmarks write random checkpoints from: the hub's names
    assert shapes["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (LORA + ROPE, 64)
    assert shapes[f"model.layers.0.self_attn.{q_name}.weight"] == (q_rows, 64)
    assert not any("qkv_a_proj" in name for name in shapes)


@pytest.mark.parametrize("family", list(Q_OF_X))
def test_a_missing_section_is_named_by_its_checkpoint_name(family, checkpoints, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    q_name = Q_OF_X[family][0]
    dst = tmp_path / family
    shutil.copytree(checkpoints[family], dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for leaf in (q_name, "kv_a_proj_with_mqa"):
        del tensors[f"model.layers.1.self_attn.{leaf}.weight"]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing: ") as err:
        load_model(dst, torch.float32, "cpu")
    missing = str(err.value).split("missing: ")[1]
    assert missing == f"model.layers.1.self_attn.kv_a_proj_with_mqa.weight, model.layers.1.self_attn.{q_name}.weight"


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("family", list(Q_OF_X))
def test_tp2_splits_q_proj_and_replicates_q_a_and_kv_a(family, rank, checkpoints):
    """Under tensor parallelism q_proj's rows split by heads as a column linear's do; q_a_proj and
    kv_a_proj_with_mqa are small and stay whole on every rank (they were ReplicatedLinears)."""
    from safetensors.torch import load_file

    from models.layers.parallel import ParallelInfo

    q_name, q_rows = Q_OF_X[family]
    ckpt = load_file(str(checkpoints[family] / "model.safetensors"))
    model = load_model(checkpoints[family], torch.float32, "cpu", parallel=ParallelInfo(rank, 2))
    attn, pre = model.model.layers[0].self_attn, "model.layers.0.self_attn."
    q = ckpt[pre + f"{q_name}.weight"]
    if q_name == "q_proj":
        q = q[rank * q_rows // 2 : (rank + 1) * q_rows // 2]
    assert attn.num_heads == H // 2 and attn.qkv_a_sections == [q.shape[0], LORA, ROPE]
    assert torch.equal(attn.qkv_a_proj.weight, torch.cat([q, ckpt[pre + "kv_a_proj_with_mqa.weight"]]))


def test_cuda_graphs_only_where_a_kernel_runs_the_mla(checkpoints, monkeypatch):
    """CUDA graphs capture DeepSeek when atomc::mla_attention lowers to a kernel (Triton); where only
    its torch reference (host-side lists) would run, the model runs without graphs."""
    from atomc.kernels import registry
    from atomc.runtime.model_runner import captures_cuda_graphs

    deepseek = load_model(checkpoints["deepseek_v3"], torch.float32, "cpu")
    llama = load_model(checkpoints["llama"], torch.float32, "cpu")
    assert not captures_cuda_graphs("cpu", deepseek) and not captures_cuda_graphs("cpu", llama)
    assert captures_cuda_graphs("cuda", llama)
    if registry.backend_available("triton"):
        assert registry.choose_backend("mla_attention", "cuda") == "triton"
        assert captures_cuda_graphs("cuda", deepseek)
    monkeypatch.setattr(registry, "backend_available", lambda backend: backend == "torch")
    assert not captures_cuda_graphs("cuda", deepseek)
    assert captures_cuda_graphs("cuda", llama)


LONG = "Once upon a time there was a small engine that compiled graphs. The capital of France is Paris."


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_prefix_hit_and_chunked_prefill_give_the_same_tokens(family, checkpoints):
    """A second prompt that extends a cached one reads its prefix from the latent cache; chunks of
    8 tokens attend over the latent of the chunks before; both give the tokens of a cold run."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(model=str(checkpoints[family]), dtype="float32", device="cpu", enforce_eager=True, block_size=4)
    llm = LLM(num_kv_blocks=256, **kw)
    tok = llm.get_tokenizer()
    first = tok(LONG).input_ids
    second = first + tok(" Later, a second question came.").input_ids
    llm.generate([{"prompt_token_ids": first}], params)
    hit = llm.generate([{"prompt_token_ids": second}], params)[0]
    assert hit.num_cached_tokens == len(first) // 4 * 4 > 8
    cold = LLM(num_kv_blocks=256, enable_prefix_caching=False, **kw).generate([{"prompt_token_ids": second}], params)
    chunked = LLM(num_kv_blocks=256, enable_prefix_caching=False, max_num_batched_tokens=8, **kw)
    chunks = chunked.generate([{"prompt_token_ids": second}], params)
    assert cold[0].num_cached_tokens == 0 and len(second) > 16
    assert hit.outputs[0].token_ids == cold[0].outputs[0].token_ids == chunks[0].outputs[0].token_ids


def test_mtp_layers_of_a_v3_checkpoint_are_skipped_and_other_extras_refused(checkpoints, tmp_path):
    """A V3/R1 checkpoint stores its MTP module as the layer after the last: those tensors load as
    nothing; a tensor of any other unknown layer is still named as unexpected."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    def copy_with(extra: str, mtp: int):
        dst = tmp_path / f"{extra}-{mtp}"
        shutil.copytree(checkpoints["deepseek_v3"], dst)
        tensors = load_file(str(dst / "model.safetensors"))
        tensors[extra] = torch.zeros(4, 4)
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": mtp}))
        return dst

    load_model(copy_with("model.layers.3.eh_proj.weight", 1), torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"unexpected: model\.layers\.4\.eh_proj\.weight"):
        load_model(copy_with("model.layers.4.eh_proj.weight", 1), torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"unexpected: model\.layers\.3\.eh_proj\.weight"):
        load_model(copy_with("model.layers.3.eh_proj.weight", 0), torch.float32, "cpu")


def config(family: str, **extra) -> dict:
    cfg = transformers.AutoConfig.for_model(
        FAMILIES[family]["cls"].removesuffix("Config").lower().replace("deepseekv", "deepseek_v"),
    ).to_dict()
    cfg.update(architectures=[f"DeepseekV{family[-1]}ForCausalLM"], num_hidden_layers=2, **extra)
    cfg["num_experts_per_tok"] = cfg["num_experts_per_tok"] or 6  # V2's default config leaves it unset
    return cfg


@pytest.mark.parametrize(
    "family, extra, message",
    [
        ("deepseek_v3", dict(moe_layer_freq=2), "moe_layer_freq=2 is not supported"),
        ("deepseek_v3", dict(scoring_func="softmax"), "scoring_func='softmax' is not supported"),
        ("deepseek_v3", dict(topk_method="greedy"), "topk_method='greedy' is not supported"),
        ("deepseek_v2", dict(topk_method="noaux_tc"), "topk_method='noaux_tc' is not supported"),
        ("deepseek_v2", dict(norm_topk_prob=True), "norm_topk_prob=true is not supported"),
        ("deepseek_v2", dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
        ("deepseek_v3", dict(n_group=4, topk_group=None), "only one of n_group / topk_group"),
        # DeepSeek's own block-FP8 layout loads (tests/quant/test_fp8_deepseek.py); other layouts are refused
        ("deepseek_v3", dict(quantization_config={"quant_method": "fp8"}), "without weight_block_size"),
        ("deepseek_v3", dict(quantization_config={"quant_method": "quark"}), "quant_method='quark' is not supported"),
        ("deepseek_v2", dict(attention_bias=True, q_lora_rank=None), "attention_bias=true without q_lora_rank is"),
    ],
)
def test_unsupported_settings_fail_at_parsing(family, extra, message):
    from models.registry import parse_family_config

    cfg = config(family)
    assert parse_family_config(ModelArch.from_dict(cfg)).kv_lora_rank == 512  # the defaults parse
    with pytest.raises(ValueError, match=message):
        parse_family_config(ModelArch.from_dict({**cfg, **extra}))


VARIANTS = {  # the other supported routing/rope settings, as transformers computes them
    # one group of two experts kept for top-2: the choice differs from plain greedy whenever a
    # token's two best experts sit in different groups
    "v2_group_limited": ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=1)),
    "v3_no_interleave_no_renorm": ("deepseek_v3", dict(rope_interleave=False, norm_topk_prob=False)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_variants_match_transformers(variant, tmp_path, monkeypatch):
    from tests.conftest import build_checkpoint

    base, extra = VARIANTS[variant]
    monkeypatch.setitem(FAMILIES, variant, {**FAMILIES[base], **extra})
    path = build_checkpoint(variant, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = load_model(path, torch.float32, "cpu")
    spec = model.model.layers[-1].mlp.experts.spec
    assert spec.num_expert_group == 4 and spec.topk_group == (1 if base == "deepseek_v2" else 2)
    assert not spec.renormalize
    assert model.config.rope_interleave == (base == "deepseek_v2")
    ids = torch.arange(3, 40) * 7 % 384
    router_logits = []
    model.model.layers[-1].mlp.gate.register_forward_hook(lambda _m, _i, out: router_logits.append(out))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        out = model.compute_logits(model(ids, torch.arange(ids.numel())))
    assert (out - ref).abs().max().item() < 1e-3
    if base == "deepseek_v2":  # the groups changed some tokens' experts
        args = (router_logits[0], spec.top_k, spec.scoring, spec.renormalize, None)
        grouped, plain = select_experts(*args, 4, 1)[1], select_experts(*args)[1]
        assert (grouped.sort(-1).values != plain.sort(-1).values).any(-1).sum() > 3


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_compiled_greedy_matches_transformers(family, checkpoints, tmp_path):
    """32 greedy tokens from the compiled artifact (the latent-attention op is a graph cut) equal
    transformers' generate, up to near-ties."""
    from tests.greedy import assert_greedy_agree

    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[family], dtype=torch.float32).eval()
    llm = LLM(model=str(checkpoints[family]), dtype="float32", device="cpu", cache_dir=str(tmp_path))
    assert llm.engine.runner.compile_info["format"] == "aot_fn"
    prompts = ["The capital of France is", "def add(a, b):\n"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    tok = llm.get_tokenizer()
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tok(prompt, return_tensors="pt").input_ids
        ref = hf.generate(ids, do_sample=False, max_new_tokens=32, min_new_tokens=32)[0, ids.shape[1] :].tolist()

        def hf_logits(seq):
            with torch.no_grad():
                return hf(torch.tensor([seq])).logits[0]

        assert len(out.outputs[0].token_ids) == 32
        assert_greedy_agree(out.outputs[0].token_ids, ref, ids[0].tolist(), hf_logits)


@pytest.mark.parametrize("fused", [True, False], ids=["inside", "beside"])
@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_shared_experts_inside_or_beside_the_moe_op_match_transformers(
    family, fused, checkpoints, monkeypatch, tmp_path
):
    """With FUSE_SHARED_EXPERTS (the default) the shared MLP loads into the MoE op's experts after the
    routed ones (cut into n_shared_experts experts of the routed width) and runs there; without it,
    a GatedMLP beside the op. Either way the prompt logits and 32 compiled greedy tokens match
    transformers."""
    from models import deepseek
    from tests.greedy import assert_greedy_agree

    monkeypatch.setattr(deepseek, "FUSE_SHARED_EXPERTS", fused)
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[family], dtype=torch.float32).eval()
    model = load_model(checkpoints[family], torch.float32, "cpu")
    c = model.config
    shared = c.shared_intermediate_size // c.moe.intermediate_size
    mlp = model.model.layers[-1].mlp
    assert (mlp.shared_experts is None) == fused and mlp.experts.spec.shared_experts == shared * fused
    assert mlp.experts.w13_weight.shape[0] == c.moe.num_experts + shared * fused
    # the checkpoint's shared down_proj, column block j, is shared expert j's w2
    hf_down = hf.model.layers[-1].mlp.shared_experts.down_proj.weight
    for j in range(shared * fused):
        got = mlp.experts.w2_weight[c.moe.num_experts + j]
        assert torch.equal(got, hf_down[:, j * c.moe.intermediate_size : (j + 1) * c.moe.intermediate_size])
    ids = torch.arange(3, 40) * 7 % 384
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        out = model.compute_logits(model(ids, torch.arange(ids.numel())))
    assert (out - ref).abs().max().item() < 1e-3
    llm = LLM(model=str(checkpoints[family]), dtype="float32", device="cpu", cache_dir=str(tmp_path))
    layer = llm.engine.runner.model.model.layers[-1].mlp
    assert (layer.shared_experts is None) == fused  # the engine's model was built with the same switch
    prompt = [5, 17, 33, 2, 99, 150, 7, 8]
    got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    want = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32, min_new_tokens=32)

    def hf_logits(seq):
        with torch.no_grad():
            return hf(torch.tensor([seq])).logits[0]

    assert_greedy_agree(got[0].outputs[0].token_ids, want[0, len(prompt) :].tolist(), prompt, hf_logits)
