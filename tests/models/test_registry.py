"""The registry and config parsing: runtime fields for every family without model code, each family's
own fields, per-layer KV specs, and clear errors for what atomc does not run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from models.arch import ModelArch
from models.registry import SUPPORTED_ARCHITECTURES, check_supported, parse_family_config

BASE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=100, max_position_embeddings=512, eos_token_id=[2, 7], bos_token_id=1,
)  # fmt: skip


def config(arch: str, model_type: str, **kw) -> dict:
    return {**BASE, "architectures": [arch], "model_type": model_type, **kw}


def test_unsupported_architecture_lists_the_supported_ones():
    with pytest.raises(ValueError) as err:
        check_supported("GPT2LMHeadModel")
    for name in SUPPORTED_ARCHITECTURES:
        assert name in str(err.value)
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported"):
        ModelArch.from_dict(config("GPT2LMHeadModel", "gpt2"))


def test_config_parsing_imports_no_model_code(checkpoints):
    """ModelArch (what the engine reads) imports neither torch nor any family module."""
    from tests.conftest import FAMILIES

    # (folder, layers): 2 unless the fixture family sets its own (GPT-OSS alternates over 4)
    dirs = json.dumps({f: (str(d), FAMILIES[f].get("num_hidden_layers", 2)) for f, d in checkpoints.items()})
    code = f"""
import json, sys
from models.arch import ModelArch
for fam, (d, layers) in json.loads({dirs!r}).items():
    a = ModelArch.from_dir(d)
    assert a.num_layers == layers and a.vocab_size == 384, fam
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith(("models.", "atomc")))
print(json.dumps(loaded))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == ["models.arch", "models.registry"]


def test_runtime_fields():
    a = ModelArch.from_dict(config("LlamaForCausalLM", "llama", head_dim=32, torch_dtype="bfloat16"))
    assert (a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim, a.vocab_size) == (3, 4, 2, 32, 100)
    assert (a.eos_token_ids, a.bos_token_id, a.torch_dtype, a.sliding_window) == ([2, 7], 1, "bfloat16", None)
    assert ModelArch.from_dict(config("LlamaForCausalLM", "llama")).head_dim == 16  # hidden / heads


def test_llama_family_fields():
    c = parse_family_config(ModelArch.from_dict(config("LlamaForCausalLM", "llama", attention_bias=True)))
    assert (c.qkv_bias, c.o_bias, c.mlp_bias, c.qk_norm) == (True, True, False, False)
    old = config("LlamaForCausalLM", "llama", rope_theta=5e5, rope_scaling={"rope_type": "linear", "factor": 2.0})
    new = config("LlamaForCausalLM", "llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5})
    for raw in (old, new):  # both spellings of the RoPE fields
        c = parse_family_config(ModelArch.from_dict(raw))
        assert c.rope_theta == 5e5 and c.rope_scaling["factor"] == 2.0


def test_qwen2_and_qwen3_fields():
    q2 = parse_family_config(ModelArch.from_dict(config("Qwen2ForCausalLM", "qwen2")))
    assert (q2.qkv_bias, q2.o_bias, q2.qk_norm) == (True, False, False)
    q3 = parse_family_config(ModelArch.from_dict(config("Qwen3ForCausalLM", "qwen3", rms_norm_eps=1e-5)))
    assert (q3.qkv_bias, q3.o_bias, q3.qk_norm, q3.rms_norm_eps) == (False, False, True, 1e-5)


def test_sliding_window_per_layer():
    mistral = ModelArch.from_dict(config("MistralForCausalLM", "mistral", sliding_window=4096))
    assert mistral.layer_sliding_windows() == [4096] * 3
    off = ModelArch.from_dict(config("Qwen2ForCausalLM", "qwen2", sliding_window=4096, use_sliding_window=False))
    assert off.sliding_window is None and off.layer_sliding_windows() == [None] * 3
    types = ["full_attention", "sliding_attention", "sliding_attention"]
    mixed = ModelArch.from_dict(
        config("Qwen2ForCausalLM", "qwen2", sliding_window=64, use_sliding_window=True, layer_types=types)
    )
    assert mixed.layer_sliding_windows() == [None, 64, 64]
    old_qwen2 = config("Qwen2ForCausalLM", "qwen2", sliding_window=64, use_sliding_window=True, max_window_layers=2)
    assert old_qwen2.get("layer_types") is None
    assert ModelArch.from_dict(old_qwen2).layer_sliding_windows() == [None, None, 64]


def test_kv_cache_specs_follow_the_config():
    import torch

    from atomc.kv_spec import PagedAttentionSpec
    from models.loader.safetensors import build_on_meta

    model = build_on_meta(
        ModelArch.from_dict(config("MistralForCausalLM", "mistral", sliding_window=256)), torch.float32
    )
    assert model.kv_cache_specs() == [PagedAttentionSpec(num_kv_heads=2, head_dim=16, sliding_window=256)] * 3
    model = build_on_meta(ModelArch.from_dict(config("Qwen3ForCausalLM", "qwen3", head_dim=32)), torch.float32)
    assert model.kv_cache_specs() == [PagedAttentionSpec(2, 32, None)] * 3


@pytest.mark.parametrize(
    "extra, message",
    [
        (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
        (dict(rope_scaling={"rope_type": "longrope", "factor": 4.0}), "rope scaling 'longrope' is not supported"),
        (dict(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.75}), "partial rotary"),
    ],
)
def test_unsupported_family_settings_fail_at_parsing(extra, message):
    with pytest.raises(ValueError, match=message):
        parse_family_config(ModelArch.from_dict(config("Phi3ForCausalLM", "phi3", **extra)))
