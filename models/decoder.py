"""The pre-norm decoder stack the dense Llama-style families share, and the CausalLM shell around it.

A family file (models/llama.py, qwen2.py, ...) parses its config.json fields into a DecoderConfig
and subclasses DecoderForCausalLM; everything else (embedding, layers, final norm, RoPE table, LM
head, tied weights, KV specs) lives here once. Module names equal the Hugging Face parameter names
after packing (q/k/v -> qkv_proj, gate/up -> gate_up_proj), which `packed_modules_mapping` declares
for the loader.

Each layer's MLP is the dense GatedMLP or, for the layers in `moe_layers`, a SparseMoEBlock
(router + FusedMoE) built from `moe`: the MoE families (models/qwen3_moe.py, mixtral.py) are the
same decoder with that choice made per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from atomc.kv_spec import PagedAttentionSpec
from models.arch import ModelArch, layer_sliding_window
from models.layers.attention import LlamaStyleAttention
from models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from models.layers.mlp import GatedMLP
from models.layers.moe import ExpertNames, MoESpec, SparseMoEBlock
from models.layers.norm import RMSNorm
from models.layers.parallel import SINGLE, ParallelInfo
from models.layers.rotary import RotaryEmbedding, rope_parameters

# checkpoint module name -> (packed module, shard id): the loader writes q/k/v and gate/up into the
# merged layers through their weight_loader; a checkpoint with fused tensors needs no entry
PACKED_QKV_GATE_UP = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


@dataclass(frozen=True)
class DecoderConfig:
    """What shapes a Llama-style decoder beyond the runtime fields of ModelArch."""

    arch: ModelArch
    hidden_size: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    attn_sinks: bool = False  # a learned sink logit per head in every softmax (GPT-OSS)
    moe: MoESpec | None = None
    moe_layers: frozenset[int] = frozenset()  # layers whose MLP is `moe`'s sparse block

    def __post_init__(self):
        if self.moe_layers and self.moe is None:
            raise ValueError("moe_layers needs a MoE spec")


def required(cfg: dict, *keys: str):
    """The first of `keys` the config has (aliases of one field), or a clear error naming them."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    arch = (cfg.get("architectures") or ["this model"])[0]
    raise ValueError(f"config.json has no {' / '.join(keys)}, which {arch} needs")


def parse_decoder_config(arch: ModelArch, **flags) -> DecoderConfig:
    """The fields every Llama-style config.json spells the same way; `flags` are the family's own."""
    cfg = arch.raw
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported for {arch.architecture} (atomc's MLP is silu-gated)")
    theta, scaling = rope_parameters(cfg)
    return DecoderConfig(
        arch=arch,
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        **flags,
    )


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig, layer_idx: int, parallel: ParallelInfo = SINGLE):
        super().__init__()
        a, h = config.arch, config.hidden_size
        self.self_attn = LlamaStyleAttention(
            h,
            a.num_heads,
            a.num_kv_heads,
            a.head_dim,
            layer_idx,
            qkv_bias=config.qkv_bias,
            o_bias=config.o_bias,
            qk_norm_eps=config.rms_norm_eps if config.qk_norm else None,
            sliding_window=layer_sliding_window(a, layer_idx),
            sinks=config.attn_sinks,
            parallel=parallel,
        )
        if layer_idx in config.moe_layers:
            self.mlp = SparseMoEBlock(h, config.moe, parallel)
        else:
            self.mlp = GatedMLP(h, config.intermediate_size, config.mlp_bias, parallel)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, config: DecoderConfig, parallel: ParallelInfo = SINGLE):
        super().__init__()
        a = config.arch
        self.embed_tokens = VocabParallelEmbedding(a.vocab_size, config.hidden_size, parallel)
        self.layers = nn.ModuleList(DecoderLayer(config, i, parallel) for i in range(a.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(a.head_dim, a.max_position_embeddings, config.rope_theta, config.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, self.rotary_emb)
        return self.norm(x)


class DecoderForCausalLM(nn.Module):
    """Subclasses set `parse_config` (config.json -> DecoderConfig) and, if their checkpoints store
    q/k/v or gate/up apart, `packed_modules_mapping`; MoE families also `expert_names` (how their
    checkpoints spell expert tensors) and `checkpoint_renames` (checkpoint module name -> ours,
    e.g. Mixtral's block_sparse_moe -> mlp)."""

    packed_modules_mapping: dict[str, tuple[str, object]] = {}
    expert_names: ExpertNames | None = None
    checkpoint_renames: dict[str, str] = {}

    @staticmethod
    def parse_config(arch: ModelArch) -> DecoderConfig:
        raise NotImplementedError

    def __init__(self, arch: ModelArch, parallel: ParallelInfo = SINGLE):
        super().__init__()
        self.arch, self.parallel = arch, parallel
        self.config = self.parse_config(arch)
        self.model = DecoderModel(self.config, parallel)
        self.lm_head = ParallelLMHead(arch.vocab_size, self.config.hidden_size, parallel)
        if arch.tie_word_embeddings:  # one Parameter: the loader's materialisation keeps it shared
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] for a flat batch; logits are computed only where needed."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def kv_cache_specs(self) -> list[PagedAttentionSpec]:
        """One spec per layer, with this rank's KV heads (what this process allocates)."""
        return [
            PagedAttentionSpec(layer.self_attn.num_kv_heads, layer.self_attn.head_dim, window)
            for layer, window in zip(self.model.layers, self.arch.layer_sliding_windows(), strict=True)
        ]
