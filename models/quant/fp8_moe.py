"""FP8 experts: the MoE method (models/quant/mxfp4.py's `MoEMethod`) that stores FusedMoE's experts
in e4m3 with their scales, for FP8 checkpoints of MoE models and `--quantization fp8`.

The MoE op runs them weight-only (atomc::moe_quant's "fp8_channel" / "fp8_block": the weights are
dequantised in registers, activations stay in the model dtype), so only the checkpoint's weight
side matters; its activation scheme does not change what runs:
- block 128x128 (HF `weight_block_size` [128, 128]: Qwen3-FP8, DeepSeek-V3/R1; compressed-tensors
  FP8_BLOCK) -> "fp8_block": `w13_weight_scale` [E, 2I/128, ceil(H/128)] (the checkpoint's
  `weight_scale_inv` per expert and part, gate blocks then up blocks), `w2_weight_scale`
  [E, ceil(H/128), I/128]. Gate and up must each be whole blocks (I a multiple of 128, per rank).
- per-channel (compressed-tensors FP8_DYNAMIC, Quark per_channel: `weight_scale` [N] or [N, 1]) and
  per-tensor (HF fp8 without a block size, Mixtral-FP8 style; compressed-tensors / Quark per-tensor:
  one `weight_scale` per expert tensor) -> "fp8_channel": `w13_weight_scale` [E, 2I],
  `w2_weight_scale` [E, H], one per row: a per-tensor scale is repeated on its tensor's rows, so gate
  and up keep their own scales and the fp8 bytes stay the checkpoint's (no requantisation).
- online (`--quantization fp8`): the bf16/fp32 experts load as they are, then each row is quantised
  (amax / 448) -> "fp8_channel".

Static input scales (`input_scale` / `activation_scale`, activation_scheme static) are read, checked
(one finite positive value per expert tensor) and dropped after loading: they calibrate an FP8
activation quant the weight-only MoE does not do, and leaving the activations unquantised only
removes rounding the checkpoint's authors accepted. Dynamic schemes have none to read.

Experts stay float8_e4m3fn (nothing multiplies them in FP8: the kernels only dequantise them),
except on a ROCm GPU that runs AITER, where the experts AITER's fused_moe takes are laid out for it
after loading (models/quant/aiter.py: float8_e4m3fnuz on MI300, pre-shuffled; the "_shuffled"
formats), and run there W8A8 (atomc/kernels/aiter/moe_quant.py).
"""

from __future__ import annotations

import torch
from torch import nn

from atomc.ops.moe_quant import FP8_BLOCK
from models.quant.aiter import experts_for_aiter
from models.quant.base import set_weight_attrs
from models.quant.fp8 import FP8_DTYPE, quantize_per_row
from models.quant.mxfp4 import MoEMethod
from models.quant.spec import FP8Scheme, QuantConfigError, experts_format

# checkpoint leaf spellings -> ours, under each stacked weight (the loader's quant_tensor_aliases)
_LEAF_ALIASES = (("weight_scale_inv", "weight_scale"), ("activation_scale", "input_scale"))


class Fp8MoEMethod(MoEMethod):
    params = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")

    def __init__(self, scheme: FP8Scheme, method: str = "fp8"):
        self.scheme = scheme
        self.weight_format = experts_format(scheme, method)  # refuses blocks other than 128x128
        self.static_inputs = scheme.activation == "static" and not scheme.online

    @property
    def aliases(self) -> dict[str, str]:
        """The checkpoint's other spellings of our parameters (the loader tries them)."""
        return {f"{w}_{theirs}": f"{w}_{ours}" for w in ("w13", "w2") for theirs, ours in _LEAF_ALIASES}

    def create_weights(self, layer: nn.Module, weight_loader) -> None:
        e, i, h = layer.expert_rows, layer.local_intermediate, layer.hidden_size
        if self.scheme.online:  # the checkpoint's dense experts, quantised after loading
            dtype = torch.get_default_dtype()
            self._register(layer, "w13_weight", (e, 2 * i, h), dtype, weight_loader)
            self._register(layer, "w2_weight", (e, h, i), dtype, weight_loader)
            return
        self._register(layer, "w13_weight", (e, 2 * i, h), FP8_DTYPE, weight_loader)
        self._register(layer, "w2_weight", (e, h, i), FP8_DTYPE, weight_loader)
        if self.weight_format == "fp8_block":
            b = FP8_BLOCK
            for what, size in (("intermediate size", layer.intermediate_size), ("intermediate size on this rank", i)):
                if size % b:
                    raise QuantConfigError(
                        f"block FP8 experts: the {what} ({size}) is not a multiple of the weight block's {b} rows "
                        "(weight_block_size): gate and up are stacked in one weight, each must be whole blocks"
                    )
            self._register(layer, "w13_weight_scale", (e, 2 * i // b, -(-h // b)), torch.float32, weight_loader,
                           n_pack=b)  # fmt: skip
            self._register(layer, "w2_weight_scale", (e, -(-h // b), i // b), torch.float32, weight_loader, k_pack=b)
        else:
            rows = self._row_scale_loader(layer, weight_loader)
            self._register(layer, "w13_weight_scale", (e, 2 * i), torch.float32, rows)
            self._register(layer, "w2_weight_scale", (e, h), torch.float32, rows, has_input_dim=False)
        if self.static_inputs:
            for name, parts in (("w13_input_scale", 2), ("w2_input_scale", 1)):
                self._register(layer, name, (e, parts), torch.float32, _input_scale_loader(layer))

    @staticmethod
    def _register(layer, name, shape, dtype, loader, **attrs) -> None:
        p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        attrs |= {"weight_loader": loader, "moe_param": name, "shard_ids": layer.shard_ids_of(name)}
        set_weight_attrs(p, attrs)
        layer.register_parameter(name, p)

    def _row_scale_loader(self, layer, weight_loader):
        """Per-row scales as FusedMoE's loader takes them: [N, 1] flattened; a per-tensor scale
        (one value per expert tensor) repeated on that tensor's rows (I for gate / up, H for down)."""
        per_tensor = self.scheme.weight == "tensor"

        def load(param, loaded, shard_id=None):
            if shard_id is not None and per_tensor:
                if loaded.numel() != 1:
                    raise ValueError(f"has shape {tuple(loaded.shape)}, but a per-tensor weight scale is one value")
                shared = layer.num_shared if shard_id[0] == "shared" else 1  # the shared MLP: S experts' rows
                rows = layer.hidden_size if shard_id[1] == "down" else layer.intermediate_size * shared
                loaded = loaded.reshape(()).expand(rows)
            elif loaded.dim() >= 2 and loaded.shape[-1] == 1:  # compressed-tensors' [N, 1]
                loaded = loaded.squeeze(-1)
            return weight_loader(param, loaded, shard_id)

        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.scheme.online:
            for name in ("w13_weight", "w2_weight"):
                dense = getattr(layer, name).data
                q = torch.empty(dense.shape, dtype=FP8_DTYPE, device=dense.device)
                scale = torch.empty(dense.shape[:2], dtype=torch.float32, device=dense.device)
                for x in range(dense.shape[0]):  # an expert at a time: one fp32 copy of one expert at most
                    q[x], scale[x] = quantize_per_row(dense[x])
                setattr(layer, name, nn.Parameter(q, requires_grad=False))
                layer.register_parameter(f"{name}_scale", nn.Parameter(scale, requires_grad=False))
        if self.static_inputs:  # read and checked at load, not used (module docstring)
            for name in ("w13_input_scale", "w2_input_scale"):
                s = getattr(layer, name)
                if not (torch.isfinite(s).all() and (s > 0).all()):
                    raise QuantConfigError(f"FP8 experts: a {name.removeprefix('w13_').removeprefix('w2_')} "
                                           "of the checkpoint is not a finite positive number")  # fmt: skip
                delattr(layer, name)
        experts_for_aiter(layer, self)  # a no-op except on a ROCm GPU that runs AITER


def _input_scale_loader(layer):
    """One static input scale per expert tensor into [E_local, parts] (gate, up | down); other
    expert-parallel ranks' experts are skipped, as FusedMoE's loader does."""

    @torch.no_grad()
    def load(param, loaded, shard_id=None):
        if shard_id is None:
            raise ValueError("is a stacked input scale; atomc reads FP8 experts' input scales one per expert tensor")
        if loaded.numel() != 1:
            raise ValueError(f"has shape {tuple(loaded.shape)}, but a static input scale is one value")
        expert, part = shard_id
        column = {"gate": 0, "up": 1, "down": 0}[part]
        if expert == "shared":  # one scale for the shared MLP's tensor: each of its experts'
            first = layer.num_local_experts
            param.data[first : first + layer.num_shared, column] = loaded.reshape(()).float()
            return
        local = layer.local_expert(expert)
        if local is not None:
            param.data[local, column] = loaded.reshape(()).float()

    return load
