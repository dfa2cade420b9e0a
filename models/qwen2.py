"""Qwen2 / Qwen2.5: Llama-style with a bias on q, k and v (none on o or the MLP)."""

from __future__ import annotations

from models.arch import ModelArch
from models.decoder import PACKED_QKV_GATE_UP, DecoderConfig, DecoderForCausalLM, parse_decoder_config


class Qwen2ForCausalLM(DecoderForCausalLM):
    packed_modules_mapping = PACKED_QKV_GATE_UP

    @staticmethod
    def parse_config(arch: ModelArch) -> DecoderConfig:
        return parse_decoder_config(arch, qkv_bias=True)
