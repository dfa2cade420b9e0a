"""quantization_config -> FP8 schemes: each dialect's layouts, skip lists, and one clear error per
class of unsupported or inconsistent config (the message names the field)."""

from __future__ import annotations

import copy

import pytest

from models.quant.spec import FP8Scheme, QuantConfigError, parse_quantization_config, resolve
from tests.quant.fp8_checkpoints import quark_config

CT_FP8_DYNAMIC = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "ignore": ["lm_head", "re:.*mlp.down_proj$"],
    "kv_cache_scheme": None,
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"type": "float", "num_bits": 8, "strategy": "channel", "dynamic": False},
            "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True},
        }
    },
}  # fmt: skip
CT_KV = {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False, "symmetric": True}
DEEPSEEK_V3 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def test_hf_fp8_block_is_deepseek_v3s_layout():
    spec = parse_quantization_config(DEEPSEEK_V3)
    s = spec.scheme_for("model.layers.0.self_attn.q_proj")
    assert (s.weight, s.activation, s.block) == ("block", "group", (128, 128))


def test_hf_fp8_per_tensor_static_and_dynamic_and_its_skips():
    static = parse_quantization_config(
        {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    )
    assert static.scheme_for("model.layers.0.mlp.up_proj") == FP8Scheme(
        "tensor", "static", aliases=static.default.aliases
    )
    assert static.scheme_for("lm_head") is None
    dyn = parse_quantization_config({"quant_method": "fp8", "modules_to_not_convert": ["mlp.gate"]})
    assert dyn.default.activation == "tensor"
    assert dyn.scheme_for("model.layers.3.mlp.gate") is None and dyn.scheme_for("model.layers.3.mlp.gate_proj")
    # transformers spells the per-tensor scales weight_scale_inv / activation_scale
    assert dict(dyn.default.aliases) == {"weight_scale_inv": "weight_scale", "activation_scale": "input_scale"}


def test_compressed_tensors_fp8_dynamic_and_ignore_patterns():
    spec = parse_quantization_config(CT_FP8_DYNAMIC)
    assert spec.scheme_for("model.layers.0.self_attn.k_proj") == FP8Scheme("channel", "token")
    assert spec.scheme_for("model.layers.0.mlp.down_proj") is None  # re: pattern
    assert spec.scheme_for("lm_head") is None


def test_compressed_tensors_kv_cache_scheme_static_per_tensor_is_read():
    """llmcompressor's FP8 KV scheme: the linears' schemes as without it (the scales are read by the
    loader, models/loader/kv_scales.py)."""
    with_kv = parse_quantization_config({**CT_FP8_DYNAMIC, "kv_cache_scheme": CT_KV})
    plain = parse_quantization_config(CT_FP8_DYNAMIC)
    assert with_kv.scheme_for("model.layers.0.self_attn.q_proj") == plain.scheme_for("model.layers.0.self_attn.q_proj")


def test_compressed_tensors_targets_name_modules():
    qc = copy.deepcopy(CT_FP8_DYNAMIC)
    qc["config_groups"]["group_0"]["targets"] = ["re:.*self_attn.*"]
    spec = parse_quantization_config(qc)
    assert spec.scheme_for("model.layers.0.self_attn.o_proj") is not None
    assert spec.scheme_for("model.layers.0.mlp.up_proj") is None


def test_quark_global_layer_and_exclude():
    qc = quark_config("per_tensor", "per_tensor", False)
    qc["layer_quant_config"] = {"*down_proj": quark_config("per_channel", "per_channel", True)["global_quant_config"]}
    spec = parse_quantization_config(qc)
    assert spec.scheme_for("model.layers.1.self_attn.q_proj") == FP8Scheme("tensor", "static")
    assert spec.scheme_for("model.layers.1.mlp.down_proj") == FP8Scheme("channel", "token")
    assert spec.scheme_for("lm_head") is None
    dyn = parse_quantization_config(quark_config("per_tensor", "per_tensor", True))
    assert dyn.default == FP8Scheme("tensor", "tensor")


def test_online_flag_and_checkpoint_agreement():
    assert resolve({}) is None
    assert resolve({}, "fp8").default == FP8Scheme("channel", "token", online=True)
    assert resolve({"quantization_config": DEEPSEEK_V3}, "fp8").method == "fp8"  # the checkpoint's own
    with pytest.raises(QuantConfigError, match="already quantised.*compressed-tensors"):
        resolve({"quantization_config": CT_FP8_DYNAMIC}, "fp8")
    with pytest.raises(QuantConfigError, match="--quantization 'int8'"):
        resolve({}, "int8")


def _ct(path: str, value):
    qc = copy.deepcopy(CT_FP8_DYNAMIC)
    *head, leaf = path.split(".")
    node = qc
    for k in head:
        node = node[k]
    node[leaf] = value
    return qc


ERRORS = [
    # (config, the field the message must name)
    ({"quant_method": "gptq"}, "quant_method 'gptq'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"quant_method": "fp8", "activation_scheme": "sometimes"}, "activation_scheme 'sometimes'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    (
        {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
        "activation_scheme static",
    ),
    ({"quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}, "scale_fmt 'ue8m0'"),
    (_ct("format", "pack-quantized"), "format 'pack-quantized'"),
    (_ct("kv_cache_scheme", {"num_bits": 8}), "kv_cache_scheme.type None"),
    (_ct("kv_cache_scheme", {**CT_KV, "strategy": "attn_head"}), "kv_cache_scheme.strategy 'attn_head'"),
    (_ct("kv_cache_scheme", {**CT_KV, "dynamic": True}), "kv_cache_scheme.dynamic True"),
    (_ct("kv_cache_scheme", {**CT_KV, "num_bits": 4}), "kv_cache_scheme.num_bits 4"),
    (_ct("config_groups.group_0.weights.num_bits", 4), "group_0.weights.num_bits"),
    (_ct("config_groups.group_0.weights.type", "int"), "group_0.weights.type"),
    (_ct("config_groups.group_0.weights.strategy", "group"), "group_0.weights.strategy 'group'"),
    (_ct("config_groups.group_0.input_activations", None), "group_0.input_activations is missing"),
    (_ct("config_groups.group_0.input_activations.dynamic", False), "input_activations.strategy 'token'"),
    (_ct("config_groups.group_0.weights.strategy", "block"), "group_0.weights.block_structure"),
    (_ct("config_groups", {}), "config_groups is missing or empty"),
]


@pytest.mark.parametrize("qc, field", ERRORS, ids=[f for _, f in ERRORS])
def test_bad_configs_name_the_field(qc, field):
    with pytest.raises(QuantConfigError, match=_escape(field)):
        parse_quantization_config(qc)


def _escape(s: str) -> str:
    import re

    return re.escape(s)


def _quark(**changes):
    qc = quark_config("per_channel", "per_channel", True)
    for path, value in changes.items():
        *head, leaf = path.split("__")
        node = qc
        for k in head:
            node = node[k]
        node[leaf] = value
    return qc


QUARK_ERRORS = [
    (_quark(global_quant_config__weight__dtype="fp4"), "global_quant_config.weight.dtype 'fp4'"),
    (_quark(global_quant_config__weight__qscheme="per_group"), "weight.qscheme 'per_group'"),
    (_quark(global_quant_config__input_tensors__is_dynamic=False), "input_tensors.qscheme 'per_channel'"),
    (_quark(global_quant_config__input_tensors=None), "input_tensors is null"),
    (_quark(global_quant_config__output_tensors={"dtype": "fp8_e4m3"}), "global_quant_config.output_tensors"),
    (_quark(export__kv_cache_group=["*k_proj"]), "export.kv_cache_group"),
    (_quark(export__weight_format="fake_quantized"), "export.weight_format 'fake_quantized'"),
]


@pytest.mark.parametrize("qc, field", QUARK_ERRORS, ids=[f for _, f in QUARK_ERRORS])
def test_bad_quark_configs_name_the_field(qc, field):
    with pytest.raises(QuantConfigError, match=_escape(field)):
        parse_quantization_config(qc)
