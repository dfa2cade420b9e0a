"""Qwen3-MoE: the Qwen3 decoder (q/k RMSNorm) whose MLPs are sparse blocks of routed experts.

Routing: softmax over all experts, top `num_experts_per_tok`, renormalised over the chosen ones
only if `norm_topk_prob` (transformers' default is off; the released checkpoints turn it on).
Layer i is sparse unless it is in `mlp_only_layers` or (i + 1) % `decoder_sparse_step` != 0;
dense layers use `intermediate_size`, experts `moe_intermediate_size`. Experts have no bias.

transformers writes `num_experts` as `num_local_experts` (its attribute map); both are read.
Qwen2-MoE's shared experts are not part of this family: a config asking for one is refused.
"""

from __future__ import annotations

from models.arch import ModelArch
from models.decoder import (
    PACKED_QKV_GATE_UP,
    DecoderConfig,
    DecoderForCausalLM,
    parse_decoder_config,
    required,
)
from models.layers.moe import ExpertNames, MoESpec


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    packed_modules_mapping = PACKED_QKV_GATE_UP
    expert_names = ExpertNames({"gate_proj": "gate", "up_proj": "up", "down_proj": "down"})

    @staticmethod
    def parse_config(arch: ModelArch) -> DecoderConfig:
        cfg = arch.raw
        if cfg.get("shared_expert_intermediate_size"):
            raise ValueError(
                "shared_expert_intermediate_size is set, but atomc's Qwen3-MoE has no shared expert "
                "(Qwen2-MoE-style shared experts are not supported)"
            )
        experts = required(cfg, "num_experts", "num_local_experts")
        step = cfg.get("decoder_sparse_step") or 1
        dense = set(cfg.get("mlp_only_layers") or [])
        spec = MoESpec(
            num_experts=experts,
            top_k=required(cfg, "num_experts_per_tok"),
            intermediate_size=required(cfg, "moe_intermediate_size"),
            renormalize=bool(cfg.get("norm_topk_prob", False)),
        )
        sparse = frozenset(i for i in range(arch.num_layers) if i not in dense and (i + 1) % step == 0)
        bias = bool(cfg.get("attention_bias", False))
        return parse_decoder_config(
            arch, qkv_bias=bias, o_bias=bias, qk_norm=True, moe=spec, moe_layers=sparse if experts > 0 else frozenset()
        )
