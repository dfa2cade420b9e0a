"""The pre-norm decoder stack the dense Llama-style families share, and the CausalLM shell around it.

A family file (models/llama.py, qwen2.py, ...) parses its config.json fields into a DecoderConfig
and subclasses DecoderForCausalLM; everything else (embedding, layers, final norm, RoPE table, LM
head, tied weights, KV specs) lives here once. Module names equal the Hugging Face parameter names
after packing (q/k/v -> qkv_proj, gate/up -> gate_up_proj), which `packed_modules_mapping` declares
for the loader.

Each layer's MLP is the dense GatedMLP or, for the layers in `moe_layers`, a SparseMoEBlock
(router + FusedMoE) built from `moe`: the MoE families (models/qwen3_moe.py, mixtral.py) are the
same decoder with that choice made per layer.

The shell is family-neutral: `DecoderLayer` is the pre-norm residual layer around any attention
and MLP, `DecoderModel` builds its layers through a factory (layer i -> module), and
`DecoderForCausalLM.build_attention` / `build_mlp` / `rotary_embedding` are the family's hooks (the
Llama-style ones by default; DeepSeek supplies its latent attention and its MoE, models/deepseek.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from atomc.kv_spec import PagedAttentionSpec
from models.arch import ModelArch, layer_sliding_window
from models.layers.attention import LlamaStyleAttention
from models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from models.layers.mlp import GatedMLP
from models.layers.moe import ExpertNames, MoESpec, SparseMoEBlock, expert_sharding
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


def llama_attention(config: DecoderConfig, layer_idx: int, parallel: ParallelInfo = SINGLE) -> LlamaStyleAttention:
    a = config.arch
    return LlamaStyleAttention(
        config.hidden_size,
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


def llama_mlp(config: DecoderConfig, layer_idx: int, parallel: ParallelInfo = SINGLE) -> nn.Module:
    if layer_idx in config.moe_layers:
        return SparseMoEBlock(config.hidden_size, config.moe, *expert_sharding(parallel))
    return GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, parallel)


class DecoderLayer(nn.Module):
    """x + self_attn(input_layernorm(x)), then x + mlp(post_attention_layernorm(x)).

    `self_attn` is called as (positions, x, rope) and `mlp` as (x): any attention and MLP with those
    forwards (LlamaStyleAttention, MLAAttention; GatedMLP, a MoE block)."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, rms_norm_eps: float):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


def llama_style_layer(config: DecoderConfig, layer_idx: int, parallel: ParallelInfo = SINGLE) -> DecoderLayer:
    """The Llama-style families' layer i (what DecoderForCausalLM builds by default)."""
    attn, mlp = llama_attention(config, layer_idx, parallel), llama_mlp(config, layer_idx, parallel)
    return DecoderLayer(attn, mlp, config.hidden_size, config.rms_norm_eps)


def stage_kv_specs(specs: list, layer_range: range) -> list:
    """The KV specs a pipeline stage allocates: one entry per layer id (the ids stay the model's),
    None where another stage holds the layer (it has no cache in this process)."""
    return [spec if i in layer_range else None for i, spec in enumerate(specs)]


class OtherStageLayer(nn.Module):
    """The place of a decoder layer another pipeline stage holds: no weights, never called (the
    layer indices, the checkpoint names and the KV cache's layer ids stay the model's own)."""


class DecoderModel(nn.Module):
    """embed_tokens -> layers (built by `make_layer(i)`) -> norm, with the RoPE table every layer uses.

    A pipeline stage (`parallel.stages` > 1) builds its own layers only; the embedding lives on the
    first stage (and on the last too when the LM head is tied to it), the norm on the last. A stage
    after the first takes the previous stage's hidden states instead of token ids."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        rms_norm_eps: float,
        num_layers: int,
        make_layer: Callable[[int], nn.Module],
        rotary_emb: RotaryEmbedding,
        parallel: ParallelInfo = SINGLE,
        tied_head: bool = False,
    ):
        super().__init__()
        self.layer_range = parallel.stage_layers(num_layers)
        embed = parallel.first_stage or (tied_head and parallel.last_stage)
        self.embed_tokens = VocabParallelEmbedding(vocab_size, hidden_size, parallel) if embed else None
        self.layers = nn.ModuleList(
            make_layer(i) if i in self.layer_range else OtherStageLayer() for i in range(num_layers)
        )
        self.norm = RMSNorm(hidden_size, rms_norm_eps) if parallel.last_stage else None
        self.first_stage = parallel.first_stage
        self.rotary_emb = rotary_emb

    def stage_layers(self) -> list[nn.Module]:
        """The decoder layers this process holds, in order."""
        return [self.layers[i] for i in self.layer_range]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None = None):
        if self.first_stage:
            x = self.embed_tokens(input_ids)
        elif hidden is None:
            raise ValueError("a pipeline stage after the first takes the previous stage's hidden states")
        else:
            x = hidden
        for i in self.layer_range:
            x = self.layers[i](positions, x, self.rotary_emb)
        return self.norm(x) if self.norm is not None else x


class DecoderForCausalLM(nn.Module):
    """Subclasses set `parse_config` (config.json -> their config: a DecoderConfig for the
    Llama-style families; any config with `hidden_size` and `rms_norm_eps` for the others) and, if
    their checkpoints store q/k/v or gate/up apart, `packed_modules_mapping`; MoE families also
    `expert_names` (how their checkpoints spell expert tensors) and `checkpoint_renames` (checkpoint
    module name -> ours, e.g. Mixtral's block_sparse_moe -> mlp). A family whose layers are not
    Llama-style overrides `build_attention` / `build_mlp` / `rotary_embedding` / `kv_cache_specs`."""

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
        c = self.config
        rope = self.rotary_embedding()
        self.model = DecoderModel(
            arch.vocab_size, c.hidden_size, c.rms_norm_eps, arch.num_layers, self.build_layer, rope, parallel,
            tied_head=arch.tie_word_embeddings,
        )  # fmt: skip
        self.lm_head = ParallelLMHead(arch.vocab_size, c.hidden_size, parallel) if parallel.last_stage else None
        if arch.tie_word_embeddings and self.lm_head is not None:  # one Parameter, kept shared by the loader
            self.lm_head.weight = self.model.embed_tokens.weight

    def build_attention(self, layer_idx: int) -> nn.Module:
        return llama_attention(self.config, layer_idx, self.parallel)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return llama_mlp(self.config, layer_idx, self.parallel)

    def build_layer(self, layer_idx: int) -> DecoderLayer:
        attn, mlp = self.build_attention(layer_idx), self.build_mlp(layer_idx)
        return DecoderLayer(attn, mlp, self.config.hidden_size, self.config.rms_norm_eps)

    def rotary_embedding(self) -> RotaryEmbedding:
        a, c = self.arch, self.config
        return RotaryEmbedding(a.head_dim, a.max_position_embeddings, c.rope_theta, c.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None = None):
        """Hidden states [T, hidden] for a flat batch; logits are computed only where needed. A
        pipeline stage after the first starts from `hidden`, the previous stage's output."""
        return self.model(input_ids, positions, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            raise ValueError("only the last pipeline stage holds the LM head")
        return self.lm_head.compute_logits(hidden)

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """A pipeline stage skips the tensors of the layers, embedding, norm and head it does not hold."""
        if self.parallel.stages == 1:
            return False
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isdigit():
            i = int(parts[2])
            return i < self.arch.num_layers and i not in self.model.layer_range
        if parts[:2] == ["model", "embed_tokens"]:
            return self.model.embed_tokens is None
        if parts[:2] == ["model", "norm"]:
            return self.model.norm is None
        return parts[0] == "lm_head" and self.lm_head is None

    def kv_cache_specs(self) -> list[PagedAttentionSpec | None]:
        """One spec per layer, with this rank's KV heads (what this process allocates); under
        pipeline parallelism None for the layers of the other stages."""
        held = self.model.layer_range
        windows = self.arch.layer_sliding_windows()
        return [
            PagedAttentionSpec(layer.self_attn.num_kv_heads, layer.self_attn.head_dim, window) if i in held else None
            for i, (layer, window) in enumerate(zip(self.model.layers, windows, strict=True))
        ]
