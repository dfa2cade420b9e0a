"""Qwen3 (dense): Llama-style with an RMSNorm over each head's q and k before RoPE.

`attention_bias` (off in the released checkpoints) biases q/k/v and o, as in Hugging Face's Qwen3.
"""

from __future__ import annotations

from models.arch import ModelArch
from models.decoder import PACKED_QKV_GATE_UP, DecoderConfig, DecoderForCausalLM, parse_decoder_config


class Qwen3ForCausalLM(DecoderForCausalLM):
    packed_modules_mapping = PACKED_QKV_GATE_UP

    @staticmethod
    def parse_config(arch: ModelArch) -> DecoderConfig:
        bias = bool(arch.raw.get("attention_bias", False))
        return parse_decoder_config(arch, qkv_bias=bias, o_bias=bias, qk_norm=True)
