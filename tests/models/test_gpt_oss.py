"""GPT-OSS beyond the family-wide tests (tests/models/test_families.py, tests/graphs/test_engine.py):
its fixture checkpoint really exercises sinks and windows, its stacked experts load into FusedMoE's
layout, prompts longer than the window generate transformers' greedy tokens eager and compiled (with
chunked prefill and a prefix-cache hit), and bad quantisation configs are refused clearly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors import safe_open

from atomc import LLM, SamplingParams
from models.arch import ModelArch
from models.loader import load_model
from models.registry import parse_family_config
from tests.greedy import assert_greedy_agree

WINDOW = 8


@pytest.fixture(scope="module")
def ckpt(checkpoints):
    return checkpoints["gpt_oss"]


@pytest.fixture(scope="module")
def hf(ckpt):
    return transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def logits(model, ids):
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(ids.numel())))


def test_layers_alternate_windows_and_carry_sinks_and_biases(ckpt):
    model = load_model(ckpt, torch.float32, "cpu")
    assert [s.sliding_window for s in model.kv_cache_specs()] == [WINDOW, None, WINDOW, None]
    layer = model.model.layers[0]
    assert layer.self_attn.sinks.abs().max() > 0.5  # randomised in the fixture, so they matter
    assert layer.self_attn.qkv_proj.bias is not None and layer.self_attn.o_proj.bias is not None
    assert layer.mlp.gate.bias is not None and layer.mlp.experts.w13_bias is not None
    spec = layer.mlp.experts.spec
    assert (spec.activation, spec.swiglu_alpha, spec.swiglu_limit, spec.top_k) == ("swiglu_oai", 1.702, 7.0, 2)


def test_sinks_and_windows_change_the_logits(ckpt, hf):
    """Without its sinks, or without its windows, the model is measurably another one on a prompt
    longer than the window: the logits tests would catch either being dropped."""
    ids = torch.randint(0, 384, (40,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    model = load_model(ckpt, torch.float32, "cpu")
    assert (logits(model, ids) - ref).abs().max() < 1e-3
    for layer in model.model.layers:
        layer.self_attn.sliding_window = 0
    assert (logits(model, ids) - ref).abs().max() > 1e-2
    model = load_model(ckpt, torch.float32, "cpu")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # exp(sink) = 0: plain softmax
    assert (logits(model, ids) - ref).abs().max() > 1e-2


def test_stacked_experts_load_into_fused_layout(ckpt):
    """gate_up_proj [E, H, 2I] (gate = even columns, up = odd) -> w13 [E, 2I, H] gate rows then up
    rows; down_proj [E, I, H] -> w2 [E, H, I]; biases alike; element by element."""
    model = load_model(ckpt, torch.float32, "cpu")
    experts = model.model.layers[1].mlp.experts
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
        gate_up, gate_up_b, down, down_b = (f.get_tensor(f"model.layers.1.mlp.experts.{n}") for n in names)
    i = experts.intermediate_size
    for e in (0, 5):
        for j in (0, 1, i - 1):
            assert torch.equal(experts.w13_weight[e, j], gate_up[e, :, 2 * j])
            assert torch.equal(experts.w13_weight[e, i + j], gate_up[e, :, 2 * j + 1])
            assert experts.w13_bias[e, j] == gate_up_b[e, 2 * j]
            assert experts.w13_bias[e, i + j] == gate_up_b[e, 2 * j + 1]
            assert torch.equal(experts.w2_weight[e, :, j], down[e, j])
        assert torch.equal(experts.w2_bias[e], down_b[e])


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
def test_long_prompt_greedy_matches_transformers(ckpt, hf, tmp_path, enforce_eager):
    """A 45-token prompt (over five windows) in 16-token prefill chunks, then 32 greedy tokens; then a
    second request sharing its first 32 tokens, served from the prefix cache across window and full
    layers: both equal transformers' generate (up to a near-tie, tests/greedy.py)."""
    llm = LLM(model=str(ckpt), dtype="float32", device="cpu", enforce_eager=enforce_eager,
              cache_dir=str(tmp_path), max_num_batched_tokens=16)  # fmt: skip
    base = torch.randint(3, 384, (45,), generator=torch.Generator().manual_seed(4)).tolist()
    second = base[:32] + torch.randint(3, 384, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

    def hf_logits(seq):
        with torch.no_grad():
            return hf(torch.tensor([seq])).logits[0]

    for prompt, cached in ((base, 0), (second, 32)):
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
        assert out.num_cached_tokens == cached  # two whole 16-token blocks of the first prompt
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32, min_new_tokens=32)
        assert_greedy_agree(out.outputs[0].token_ids, ref[0, len(prompt) :].tolist(), prompt, hf_logits)


def test_mxfp4_experts_need_whole_scale_groups_and_fp8_is_refused(ckpt, tmp_path):
    """MXFP4 checkpoints load (tests/quant/test_mxfp4_models.py), but this fixture's I = 48 is not a
    whole number of 32-value scale groups: a clear error, as is any other quant_method."""
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"MXFP4 experts: the intermediate size on this rank \(48\)"):
        load_model(tmp_path, torch.float32, "cpu")
    cfg["quantization_config"] = {"quant_method": "fp8"}
    with pytest.raises(ValueError, match="'fp8' is not supported"):
        parse_family_config(ModelArch.from_dict(cfg))


def test_expert_tensor_in_another_layout_is_refused(ckpt, tmp_path):
    """A stacked tensor in FusedMoE's own layout ([E, 2I, H]) is not silently transposed into garbage."""
    from safetensors.torch import load_file, save_file

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (ckpt / name).exists():
            shutil.copy(ckpt / name, tmp_path / name)
    tensors = load_file(str(ckpt / "model.safetensors"))
    key = "model.layers.0.mlp.experts.gate_up_proj"
    tensors[key] = tensors[key].transpose(1, 2).contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"gate_up_proj has shape \(6, 96, 64\).*GPT-OSS stores w13_weight"):
        load_model(tmp_path, torch.float32, "cpu")


def test_a_config_without_swiglu_limit_takes_the_fixed_limit(ckpt):
    """Older transformers versions write no swiglu_limit (their code fixes it at 7.0)."""
    from models.arch import ModelArch
    from models.gpt_oss import GptOssForCausalLM

    raw = json.loads((ckpt / "config.json").read_text())
    raw.pop("swiglu_limit", None)
    raw["swiglu_limit"] = None
    assert GptOssForCausalLM.parse_config(ModelArch.from_dict(raw)).moe.swiglu_limit == 7.0
