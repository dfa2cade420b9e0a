"""Which architectures atomc runs: HF `architectures[0]` -> the family module and its model class.

Classes are named as strings and imported on first use, so checking a config (ModelArch) imports no
model code. Each family module defines its model class, whose `parse_config` turns the config.json
fields it needs into its own config; adding a family is one module plus one line here.
"""

from __future__ import annotations

import importlib

_FAMILIES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("models.llama", "LlamaForCausalLM"),  # Llama + sliding window (a runtime field)
    "Qwen2ForCausalLM": ("models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("models.qwen3", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("models.phi3", "Phi3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("models.mixtral", "MixtralForCausalLM"),
    "GptOssForCausalLM": ("models.gpt_oss", "GptOssForCausalLM"),
    "DeepseekV2ForCausalLM": ("models.deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("models.deepseek", "DeepseekV3ForCausalLM"),
}
SUPPORTED_ARCHITECTURES = tuple(_FAMILIES)


def check_supported(architecture: str) -> str:
    if architecture not in _FAMILIES:
        raise ValueError(
            f"architecture {architecture!r} is not supported; atomc supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return architecture


def family_module(architecture: str) -> str:
    """The module that holds the family's code (what a trace of this model runs)."""
    return _FAMILIES[check_supported(architecture)][0]


def model_class(architecture: str):
    module, name = _FAMILIES[check_supported(architecture)]
    return getattr(importlib.import_module(module), name)


def parse_family_config(arch):
    """The family's own config (a DecoderConfig for the Llama-style families) from `arch.raw`."""
    return model_class(arch.architecture).parse_config(arch)


def build_model(arch, parallel=None, mtp: bool = False):
    """The model on the current default device and dtype (the loader builds it on meta). `mtp`:
    with the checkpoint's multi-token-prediction layers (families whose class sets `has_mtp`)."""
    from models.layers.parallel import SINGLE

    cls = model_class(arch.architecture)
    if not mtp:
        return cls(arch, parallel or SINGLE)
    if not getattr(cls, "has_mtp", False):
        raise ValueError(f"{arch.architecture} has no multi-token-prediction (MTP) layers to load")
    return cls(arch, parallel or SINGLE, mtp=True)
