"""GPT-OSS (bf16 / fp32 or MXFP4 experts): a Llama-style decoder with attention sinks, QKV and O biases,
alternating sliding-window and full layers (`layer_types`), YaRN RoPE, and a MoE MLP in every layer.

- Attention: each head's learned sink logit (`self_attn.sinks`) joins its softmax denominator
  (atomc::attention's `sinks`); a layer's window comes from `layer_types` (models/arch.py).
- Router: `mlp.router` (a ReplicatedLinear with bias; renamed to the block's `gate`): top-k of the
  logits, then softmax over the chosen = softmax over all, top-k, renormalise (atomc::moe's softmax).
- Experts: with biases and the clamped SwiGLU (`swiglu_oai`: alpha and `swiglu_limit` from the
  config): gate clamped above, up clamped both ways, (up + 1) * gate * sigmoid(alpha * gate).

Checkpoints store the experts stacked the way transformers' GptOssExperts holds them, which is not
FusedMoE's layout: `gate_up_proj` [E, H, 2I] is x @ W (transposed) with gate and up interleaved
(gate = [..., ::2], up = [..., 1::2]), `gate_up_proj_bias` [E, 2I] interleaved likewise,
`down_proj` [E, I, H] transposed, `down_proj_bias` [E, H]. The experts' weight loaders here turn
each into FusedMoE's layout (w13 [E, 2I, H] gate rows then up rows, w2 [E, H, I]) and then load it
as FusedMoE loads any stacked tensor (so TP slices still come out right).

The released checkpoints (`quantization_config.quant_method: mxfp4`) store the experts' weights as
`gate_up_proj_blocks` [E, 2I, H/32, 16] / `gate_up_proj_scales` [E, 2I, H/32] (rows, not columns,
interleaved; no transpose: already [out, in]) and `down_proj_blocks` [E, H, I/32, 16] /
`down_proj_scales` [E, H, I/32]; biases as in bf16 checkpoints. The loader (models/loader/quantize.py)
gives the experts the MXFP4 MoE method (models/quant/mxfp4.py) and the loaders here de-interleave
those rows too. Not here yet: the harmony chat format (the server-API issue).
"""

from __future__ import annotations

import torch
from torch import nn

from models.arch import ModelArch
from models.decoder import DecoderConfig, DecoderForCausalLM, parse_decoder_config, required
from models.layers.moe import ExpertNames, FusedMoE, MoESpec
from models.layers.parallel import SINGLE, ParallelInfo
from models.quant.mxfp4 import MXFP4_GROUP

MXFP4_PARAMS = ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales")

# checkpoint module -> packed module (q/k/v apart in GPT-OSS checkpoints; no dense MLP)
PACKED_QKV = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}


def check_quantization(cfg: dict) -> None:
    """GPT-OSS ships MXFP4 experts (models/quant/mxfp4.py); no other quantisation of it is supported."""
    method = (cfg.get("quantization_config") or {}).get("quant_method")
    if method and method != "mxfp4":
        raise ValueError(f"GPT-OSS with quantization_config.quant_method = {method!r} is not supported (mxfp4 is)")


def from_checkpoint_layout(moe_param: str, t: torch.Tensor) -> torch.Tensor:
    """A GPT-OSS stacked expert tensor in FusedMoE's layout (see the module docstring)."""
    if moe_param in MXFP4_PARAMS:  # already [E, out, in]: de-interleave the rows, flatten the 16-byte groups
        if moe_param.startswith("w13"):
            t = torch.cat([t[:, ::2], t[:, 1::2]], dim=1)
        return t.flatten(2)
    if moe_param in ("w13_weight", "w13_bias"):
        t = torch.cat([t[..., ::2], t[..., 1::2]], dim=-1)  # de-interleave: gate columns, then up
    if moe_param in ("w13_weight", "w2_weight"):
        t = t.transpose(1, 2)  # x @ W -> F.linear's [out, in]
    return t


def checkpoint_shape(moe: FusedMoE, moe_param: str) -> tuple[int, ...]:
    e, h, i = moe.num_experts, moe.hidden_size, moe.intermediate_size
    g = MXFP4_GROUP
    return {
        "w13_weight": (e, h, 2 * i),
        "w13_bias": (e, 2 * i),
        "w2_weight": (e, i, h),
        "w2_bias": (e, h),
        "w13_blocks": (e, 2 * i, h // g, g // 2),
        "w13_scales": (e, 2 * i, h // g),
        "w2_blocks": (e, h, i // g, g // 2),
        "w2_scales": (e, h, i // g),
    }[moe_param]


def install_expert_loaders(moe: FusedMoE) -> None:
    """Give the experts' parameters loaders that read GPT-OSS's stacked layout."""

    @torch.no_grad()
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        want = checkpoint_shape(moe, param.moe_param)
        if shard_id is not None or tuple(loaded.shape) != want:
            raise ValueError(
                f"has shape {tuple(loaded.shape)}, but GPT-OSS stores {param.moe_param} stacked as {want} "
                "(experts, then transformers' GptOssExperts layout)"
            )
        moe.weight_loader(param, from_checkpoint_layout(param.moe_param, loaded), None)

    for name in ("w13_weight", "w13_bias", "w2_weight", "w2_bias"):
        param = getattr(moe, name)
        if param is not None:
            param.weight_loader = load  # replaces FusedMoE's (which it calls after the conversion)
    # an MXFP4 method's parameters, created later, take w13_weight's loader (FusedMoE.set_moe_method)


class GptOssForCausalLM(DecoderForCausalLM):
    packed_modules_mapping = PACKED_QKV
    # stacked names only (ExpertNames wants per-expert names too: GPT-OSS checkpoints never use them)
    expert_names = ExpertNames(
        {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"},
        fused={
            "gate_up_proj": "w13_weight",
            "down_proj": "w2_weight",
            "gate_up_proj_bias": "w13_bias",
            "down_proj_bias": "w2_bias",
            "gate_up_proj_blocks": "w13_blocks",
            "gate_up_proj_scales": "w13_scales",
            "down_proj_blocks": "w2_blocks",
            "down_proj_scales": "w2_scales",
        },
    )
    checkpoint_renames = {"router": "gate"}

    @staticmethod
    def parse_config(arch: ModelArch) -> DecoderConfig:
        cfg = arch.raw
        check_quantization(cfg)
        spec = MoESpec(
            num_experts=required(cfg, "num_local_experts", "num_experts"),
            top_k=required(cfg, "num_experts_per_tok"),
            intermediate_size=required(cfg, "intermediate_size"),
            scoring="softmax",
            renormalize=True,
            activation="swiglu_oai",
            expert_bias=True,
            router_bias=True,
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            # configs written before transformers made it a field hold it in the code: 7.0
            swiglu_limit=float(cfg.get("swiglu_limit") or 7.0),
        )
        bias = bool(cfg.get("attention_bias", True))
        return parse_decoder_config(
            arch, qkv_bias=bias, o_bias=bias, attn_sinks=True, moe=spec, moe_layers=frozenset(range(arch.num_layers))
        )

    def __init__(self, arch: ModelArch, parallel: ParallelInfo = SINGLE):
        super().__init__(arch, parallel)
        for layer in self.model.stage_layers():
            install_expert_loaders(layer.mlp.experts)
