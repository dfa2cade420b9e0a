"""Mixtral: the Mistral decoder whose every MLP is a sparse block of `num_local_experts` experts.

Routing: softmax over all experts, top `num_experts_per_tok`, always renormalised over the chosen
ones. Experts are `intermediate_size` wide, without bias. `sliding_window` (null in the released
checkpoints) is a runtime field like Mistral's. `router_jitter_noise` only acts in training.

Hub checkpoints name the block `block_sparse_moe` and the experts' projections w1 (gate), w3 (up),
w2 (down); transformers' in-memory (and save_original_format=False) layout names it `mlp` with the
experts stacked (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`). Both load.
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


class MixtralForCausalLM(DecoderForCausalLM):
    packed_modules_mapping = PACKED_QKV_GATE_UP
    expert_names = ExpertNames({"w1": "gate", "w3": "up", "w2": "down"})
    checkpoint_renames = {"block_sparse_moe": "mlp"}

    @staticmethod
    def parse_config(arch: ModelArch) -> DecoderConfig:
        cfg = arch.raw
        spec = MoESpec(
            num_experts=required(cfg, "num_local_experts", "num_experts"),
            top_k=required(cfg, "num_experts_per_tok"),
            intermediate_size=required(cfg, "intermediate_size"),
            renormalize=True,
        )
        return parse_decoder_config(arch, moe=spec, moe_layers=frozenset(range(arch.num_layers)))
