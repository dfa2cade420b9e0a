"""Phi-3 (dense): Llama-style, but the checkpoint already stores q/k/v
fused (`qkv_proj`, sections q | k | v) and gate/up fused (`gate_up_proj`, sections gate | up).

No packed-module mapping is needed: those tensors reach the merged layers' weight_loader with
shard_id=None and the layer cuts the sections (and, under TP, this rank's slice of each) itself.
Phi-3's `longrope` scaling and partial rotary factors are rejected with a clear error by the RoPE
parser; the released 4k-context Phi-3-mini uses plain RoPE.
"""

from __future__ import annotations

from models.arch import ModelArch
from models.decoder import DecoderConfig, DecoderForCausalLM, parse_decoder_config


class Phi3ForCausalLM(DecoderForCausalLM):
    @staticmethod
    def parse_config(arch: ModelArch) -> DecoderConfig:
        return parse_decoder_config(arch)
