"""GPT-OSS (bf16 / fp32 experts): a Llama-style decoder with attention sinks, QKV and O biases,
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

Not here yet: MXFP4 experts (what the released checkpoints ship; the quantisation issue), refused
with a clear error when the config says so; the harmony chat format (the server-API issue).
"""

from __future__ import annotations

import torch
from torch import nn

from models.arch import ModelArch
from models.decoder import DecoderConfig, DecoderForCausalLM, parse_decoder_config, required
from models.layers.moe import ExpertNames, FusedMoE, MoESpec
from models.layers.parallel import SINGLE, ParallelInfo

# checkpoint module -> packed module (q/k/v apart in GPT-OSS checkpoints; no dense MLP)
PACKED_QKV = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}


def check_not_quantized(cfg: dict) -> None:
    quant = cfg.get("quantization_config") or {}
    method = quant.get("quant_method")
    if method == "mxfp4":
        raise ValueError(
            "this GPT-OSS checkpoint stores its experts in MXFP4 (quantization_config.quant_method = mxfp4), "
            "which atomc does not load yet (it comes with the quantisation work); use a bf16 checkpoint "
            "of the model (experts dequantized)"
        )
    if method:
        raise ValueError(f"GPT-OSS with quantization_config.quant_method = {method!r} is not supported")


def from_checkpoint_layout(moe_param: str, t: torch.Tensor) -> torch.Tensor:
    """A GPT-OSS stacked expert tensor in FusedMoE's layout (see the module docstring)."""
    if moe_param in ("w13_weight", "w13_bias"):
        t = torch.cat([t[..., ::2], t[..., 1::2]], dim=-1)  # de-interleave: gate columns, then up
    if moe_param in ("w13_weight", "w2_weight"):
        t = t.transpose(1, 2)  # x @ W -> F.linear's [out, in]
    return t


def checkpoint_shape(moe: FusedMoE, moe_param: str) -> tuple[int, ...]:
    e, h, i = moe.num_experts, moe.hidden_size, moe.intermediate_size
    return {"w13_weight": (e, h, 2 * i), "w13_bias": (e, 2 * i), "w2_weight": (e, i, h), "w2_bias": (e, h)}[moe_param]


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
        param.weight_loader = load  # replaces FusedMoE's (which it calls after the conversion)


class GptOssForCausalLM(DecoderForCausalLM):
    packed_modules_mapping = PACKED_QKV
    # stacked names only (ExpertNames wants per-expert names too: GPT-OSS checkpoints never use them)
    expert_names = ExpertNames({"gate_proj": "gate", "up_proj": "up", "down_proj": "down"})
    checkpoint_renames = {"router": "gate"}

    @staticmethod
    def parse_config(arch: ModelArch) -> DecoderConfig:
        cfg = arch.raw
        check_not_quantized(cfg)
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
        for layer in self.model.layers:
            install_expert_loaders(layer.mlp.experts)
