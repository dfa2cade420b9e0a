"""Which architectures atomc runs, and the class that builds each."""

from __future__ import annotations

import torch

from models.llama import LlamaForCausalLM

# HF `architectures[0]` -> model class. Mistral and Qwen2 are Llama with config switches
# (sliding window, qkv bias); Qwen3 adds q/k RMSNorm, also a switch of the same class.
_MODELS: dict[str, type[torch.nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
SUPPORTED_ARCHITECTURES = tuple(_MODELS)


def check_supported(architecture: str) -> str:
    if architecture not in _MODELS:
        raise ValueError(
            f"architecture {architecture!r} is not supported; atomc supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return architecture


def build_model(arch) -> torch.nn.Module:
    return _MODELS[check_supported(arch.architecture)](arch)
