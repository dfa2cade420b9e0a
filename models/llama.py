"""Llama 2/3/3.1 (llama3 RoPE scaling) and Mistral (Llama + a sliding window, a runtime field).

`attention_bias` puts a bias on q/k/v and o; `mlp_bias` on the MLP's three projections.
"""

from __future__ import annotations

from models.arch import ModelArch
from models.decoder import PACKED_QKV_GATE_UP, DecoderConfig, DecoderForCausalLM, parse_decoder_config


class LlamaForCausalLM(DecoderForCausalLM):
    packed_modules_mapping = PACKED_QKV_GATE_UP

    @staticmethod
    def parse_config(arch: ModelArch) -> DecoderConfig:
        bias = bool(arch.raw.get("attention_bias", False))
        return parse_decoder_config(arch, qkv_bias=bias, o_bias=bias, mlp_bias=bool(arch.raw.get("mlp_bias", False)))
