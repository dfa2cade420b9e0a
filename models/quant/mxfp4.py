"""MXFP4 experts (GPT-OSS's released checkpoints): the MoE method that stores FusedMoE's experts packed.

An MoE method is to FusedMoE what a linear method is to a linear (models/quant/base.py): it
replaces the layer's dense `w13_weight` / `w2_weight` by its own parameters (`create_weights`, on
the meta model, before loading), may repack after loading, and runs the block (`apply`). The
biases and the expert map stay the layer's.

Parameters, in FusedMoE's row layout (gate rows then up rows; this rank's experts and slice of I):
- `w13_blocks` uint8 [E_local, 2*I_local, H/2], `w13_scales` uint8 [E_local, 2*I_local, H/32];
- `w2_blocks` uint8 [E_local, H, I_local/2], `w2_scales` uint8 [E_local, H, I_local/32].
Two e2m1 values a byte along the input dim (low nibble first), one e8m0 scale per 32 values
(atomc/ops/moe_quant.py). Each carries `k_pack` (values per element along the input dim: 2 for
blocks, 32 for scales), so FusedMoE's loader slices w2's input dim (the TP split of I) in bytes
and in scale groups; I_local must then be a multiple of 32.

GPT-OSS checkpoints hold `<experts>.gate_up_proj_blocks` [E, 2I, H/32, 16] with gate and up rows
interleaved (gate even, up odd), `..._scales` [E, 2I, H/32], `down_proj_blocks` [E, H, I/32, 16],
`down_proj_scales` [E, H, I/32]: already [out, in] (unlike the bf16 checkpoints' transposed
tensors); models/gpt_oss.py de-interleaves the rows and flattens the 16-byte groups.

`quantize_mxfp4` is a plain round-to-nearest quantiser (the scale is the smallest power of two
that keeps a group's largest magnitude within e2m1's 6.0): tests and benchmarks write MXFP4
checkpoints with it; it is not meant to match any released checkpoint's quantiser bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

import atomc.ops  # noqa: F401  (registers torch.ops.atomc.moe_quant)
from atomc.ops.moe_quant import E8M0_BIAS, MXFP4_GROUP
from models.quant.aiter import experts_for_aiter
from models.quant.base import set_weight_attrs
from models.quant.spec import QuantConfigError

E2M1_MAX = 6.0
# midpoints between consecutive e2m1 magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6): round to nearest
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


class MoEMethod:
    """How a FusedMoE stores and runs its experts (the unquantised layer runs atomc::moe itself)."""

    def create_weights(self, layer: nn.Module, weight_loader) -> None:
        """Register the expert parameters, each with `weight_loader` (the layer's, or its family's)."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        return None

    # set by each method: its atomc::moe_quant format and the layer's four packed expert parameters
    # (a method laying its experts out for AITER at load moves to the format's "_shuffled" twin)
    weight_format: str
    params: tuple[str, str, str, str]  # (w13, w13 scale, w2, w2 scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, router_logits: torch.Tensor, correction_bias):
        s = layer.spec
        w13, w13_scale, w2, w2_scale = (getattr(layer, name) for name in self.params)
        return torch.ops.atomc.moe_quant(
            x,
            router_logits,
            w13,
            w13_scale,
            w2,
            w2_scale,
            layer.w13_bias,
            layer.w2_bias if layer.tp.rank == 0 else None,
            layer.expert_map,
            correction_bias,
            s.top_k,
            self.weight_format,
            *s.routing_args(),
        )


class Mxfp4MoEMethod(MoEMethod):
    weight_format = "mxfp4"
    params = ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales")

    def create_weights(self, layer: nn.Module, weight_loader) -> None:
        e, i, h = layer.expert_rows, layer.local_intermediate, layer.hidden_size
        for what, size in (("hidden size", h), ("intermediate size on this rank", i)):
            if size % MXFP4_GROUP:
                raise QuantConfigError(
                    f"MXFP4 experts: the {what} ({size}) is not a multiple of the {MXFP4_GROUP}-value scale group"
                )
        shapes = {
            "w13_blocks": ((e, 2 * i, h // 2), 2),
            "w13_scales": ((e, 2 * i, h // MXFP4_GROUP), MXFP4_GROUP),
            "w2_blocks": ((e, h, i // 2), 2),
            "w2_scales": ((e, h, i // MXFP4_GROUP), MXFP4_GROUP),
        }
        for name, (shape, pack) in shapes.items():
            p = nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)
            set_weight_attrs(p, {"weight_loader": weight_loader, "moe_param": name, "k_pack": pack,
                                 "shard_ids": layer.shard_ids_of(name)})  # fmt: skip
            layer.register_parameter(name, p)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        experts_for_aiter(layer, self)  # a no-op except on a ROCm GPU that runs AITER (models/quant/aiter.py)


MOE_METHODS = {"mxfp4": Mxfp4MoEMethod}  # quantization spec's experts format -> MoE method


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float -> (blocks uint8 [..., K/2], scales uint8 [..., K/32]), low nibble = even index."""
    k = w.shape[-1]
    if k % MXFP4_GROUP:
        raise ValueError(f"MXFP4 quantises groups of {MXFP4_GROUP} values; the last dim is {k}")
    groups = w.float().unflatten(-1, (k // MXFP4_GROUP, MXFP4_GROUP))
    amax = groups.abs().amax(dim=-1)
    exponent = torch.ceil(torch.log2(amax.clamp(min=2.0**-126) / E2M1_MAX)).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = torch.ldexp(groups, -exponent[..., None])
    bounds = torch.tensor(_E2M1_BOUNDS, device=w.device)
    magnitude = torch.bucketize(scaled.abs().clamp(max=E2M1_MAX).contiguous(), bounds, right=False)
    codes = (magnitude | torch.where(scaled < 0, 8, 0)).to(torch.uint8).flatten(-2)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + E8M0_BIAS).to(torch.uint8)
