"""FP8 (e4m3) linear methods: per-tensor, per-channel, block-scaled, and online quantisation at load;
and block-FP8 checkpoint weights dequantised at load, for a layer the model reads as a dense tensor
(DeepSeek's kv_b_proj: DequantizedFP8BlockLinearMethod).

Each creates float8_e4m3fn weights plus float32 scales tagged for the layer's weight_loader, so
merged layers (q/k/v -> qkv_proj, gate/up -> gate_up_proj) and tensor-parallel shards load scales
the way they load weights:

- per-tensor scales are `per_shard` ([one per section]): each checkpoint tensor's scale lands at its
  section's index. After loading, a merged layer's scales become one per output row ([N]), so the
  GEMM applies each section's own scale: exact (the weights stay the checkpoint's bytes) and free on
  the GPU (_scaled_mm's rowwise epilogue), where requantising every section to the largest scale
  would round the weights a second time. A single-section layer keeps its one scale (tensorwise GEMM).
  Static input scales quantise the one input all sections share, so they are reduced to their max
  (equal when calibrated on the same input, as llmcompressor and Quark do).
- per-channel scales ([N]) are split with the rows (`output_dim` 0); [N, 1] checkpoint tensors
  (compressed-tensors) load as [N].
- block scales ([ceil(N/bn), ceil(K/bk)]) carry `block` = (bn, bk): the layer counts their dims in
  blocks, so a rank's slice, and every section but the last, must be a whole number of blocks (the
  last, held whole, may end in a partial block, as a plain linear's rows may).

apply emits `atomc::fp8_quant_*` then `atomc::fp8_gemm` / `fp8_block_gemm` (atomc/ops/fp8.py).

On a device whose FP8 is float8_e4m3fnuz (MI300: `atomc.platforms.fp8_dtype`) the weights are moved
to it once after loading, exactly (atomc.ops.fp8.fn_to_fnuz: same bits, -0 -> 0, weight and static
input scales doubled), as AITER's GEMMs take them; every backend reads (q, scale) by value.

On a ROCm GPU that runs AITER the weight is then, where AITER's pre-shuffled GEMMs take the layer,
rewritten once in shuffle_weight's (16, 16) order (models/quant/aiter.py) and the method emits
`atomc::fp8_gemm_shuffled` / `fp8_block_gemm_shuffled` (atomc/ops/fp8_shuffled.py) instead: on that
platform `layer.weight` holds the same e4m3 bytes in AITER's order (same shape), and the graph's op
says so. Everywhere else nothing changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import atomc.ops  # noqa: F401  (registers torch.ops.atomc.fp8_*)
from atomc import platforms
from atomc.ops.fp8 import FNUZ_DTYPE, expand_block_scale, fn_to_fnuz
from models.quant.aiter import linear_for_aiter
from models.quant.base import LinearMethod, set_weight_attrs
from models.quant.spec import FP8_MAX, FP8Scheme, QuantConfigError

FP8_DTYPE = torch.float8_e4m3fn


def _param(shape, dtype, attrs: dict) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    set_weight_attrs(p, attrs)
    return p


def _flat_rows(weight_loader):
    """A loader that takes a per-row scale as [N] or [N, 1]."""

    def load(param, loaded, shard_id=None):
        if loaded.dim() == 2 and loaded.shape[1] == 1:
            loaded = loaded.reshape(-1)
        return weight_loader(param, loaded, shard_id)

    return load


def _register_fp8_weight(layer: nn.Module, n: int, k: int, weight_loader) -> None:
    """The [N, K] e4m3 weight both checkpoint methods load (sharded on N, sliced on K)."""
    attrs = {"output_dim": 0, "input_dim": 1, "weight_loader": weight_loader}
    layer.register_parameter("weight", _param((n, k), FP8_DTYPE, attrs))


def _replace(layer: nn.Module, name: str, value: torch.Tensor) -> None:
    setattr(layer, name, nn.Parameter(value, requires_grad=False))


def to_device_fp8(layer: nn.Module, weight_scale: str) -> None:
    """The loaded e4m3fn weight (and its scales) in the e4m3 dtype of the layer's device: a no-op
    except on MI300, where it becomes float8_e4m3fnuz with its weight and static input scales doubled."""
    if layer.weight.dtype != FP8_DTYPE or platforms.fp8_dtype(layer.weight.device) != FNUZ_DTYPE:
        return
    weight, scale = fn_to_fnuz(layer.weight.data, getattr(layer, weight_scale).data)
    _replace(layer, "weight", weight)
    _replace(layer, weight_scale, scale)
    if getattr(layer, "input_scale", None) is not None:
        _replace(layer, "input_scale", layer.input_scale.data * 2.0)


class FP8LinearMethod(LinearMethod):
    """Per-tensor or per-channel weights; static per-tensor, dynamic per-tensor or per-token inputs."""

    shuffled = False  # the weight in AITER's pre-shuffled layout (set after loading; module docstring)

    def __init__(self, scheme: FP8Scheme):
        if scheme.weight not in ("tensor", "channel") or scheme.online:
            raise QuantConfigError(f"FP8LinearMethod cannot run {scheme.describe()}")
        self.scheme = scheme

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader):
        n = sum(output_partition_sizes)
        _register_fp8_weight(layer, n, input_size_per_partition, weight_loader)
        if self.scheme.weight == "tensor":
            scale = _param(
                (len(output_partition_sizes),), torch.float32, {"per_shard": True, "weight_loader": weight_loader}
            )
        else:
            scale = _param((n,), torch.float32, {"output_dim": 0, "weight_loader": _flat_rows(weight_loader)})
        layer.register_parameter("weight_scale", scale)
        if self.scheme.activation == "static":
            shards = len(output_partition_sizes)
            layer.register_parameter(
                "input_scale", _param((shards,), torch.float32, {"per_shard": True, "weight_loader": weight_loader})
            )

    def process_weights_after_loading(self, layer):
        sizes = layer.local_output_sizes
        if self.scheme.weight == "tensor" and len(sizes) > 1:  # one scale per section -> one per row
            rows = torch.tensor(sizes, device=layer.weight_scale.device)
            _replace(layer, "weight_scale", layer.weight_scale.data.repeat_interleave(rows))
        if self.scheme.activation == "static":
            _replace(layer, "input_scale", layer.input_scale.data.amax().reshape(1))
        to_device_fp8(layer, "weight_scale")
        self.shuffled = linear_for_aiter(layer)

    def apply(self, layer, x, bias):
        if self.scheme.activation == "static":
            xq, x_scale = torch.ops.atomc.fp8_quant_static(x, layer.input_scale), layer.input_scale
        else:
            group = 0 if self.scheme.activation == "tensor" else layer.input_size_per_partition
            xq, x_scale = torch.ops.atomc.fp8_quant_dynamic(x, group)
        gemm = torch.ops.atomc.fp8_gemm_shuffled if self.shuffled else torch.ops.atomc.fp8_gemm
        return gemm(xq, x_scale, layer.weight, layer.weight_scale, bias, x.dtype)


class FP8BlockLinearMethod(LinearMethod):
    """Block-scaled weights (`weight_scale_inv` per bn x bk block), activations per token group of bk."""

    quantizes_inputs = True  # the input features must then be whole groups of bk
    shuffled = False  # the weight in AITER's pre-shuffled layout (set after loading; module docstring)

    def __init__(self, scheme: FP8Scheme):
        if scheme.weight != "block":
            raise QuantConfigError(f"FP8BlockLinearMethod cannot run {scheme.describe()}")
        self.scheme = scheme
        self.block_n, self.block_k = scheme.block

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader):
        bn, bk = self.block_n, self.block_k
        # a section split across ranks, or one that another section follows, must be whole blocks (its
        # scale rows are then its own); the last section, held whole, may end in a partial block as a
        # plain linear may (DeepSeek's kv_a_proj_with_mqa, 576 rows, after its q projection in qkv_a_proj)
        last = len(output_partition_sizes) - 1
        sections = zip(layer.shard_ids, output_partition_sizes, layer.output_sizes, strict=True)
        for i, (sid, size, full) in enumerate(sections):
            if size % bn and (size != full or i < last):
                what = f"section {sid!r} of " if sid is not None else ""
                why = "split across ranks" if size != full else "another section starts after it"
                raise QuantConfigError(
                    f"block FP8: {what}{type(layer).__name__} holds {size} rows on this rank, not a multiple "
                    f"of the weight block's {bn} rows (weight_block_size; {why})"
                )
        if self.quantizes_inputs and input_size_per_partition % bk:
            raise QuantConfigError(
                f"block FP8: {type(layer).__name__} has {input_size_per_partition} input features on this rank, "
                f"not a multiple of the weight block's {bk} columns (activations are quantised in groups of {bk})"
            )
        _register_fp8_weight(layer, sum(output_partition_sizes), input_size_per_partition, weight_loader)
        blocks_n = sum(-(-s // bn) for s in output_partition_sizes)
        attrs = {"output_dim": 0, "input_dim": 1, "block": (bn, bk), "weight_loader": weight_loader}
        layer.register_parameter(
            "weight_scale_inv", _param((blocks_n, -(-input_size_per_partition // bk)), torch.float32, attrs)
        )

    def process_weights_after_loading(self, layer):
        to_device_fp8(layer, "weight_scale_inv")
        self.shuffled = linear_for_aiter(layer, (self.block_n, self.block_k))

    def apply(self, layer, x, bias):
        xq, x_scale = torch.ops.atomc.fp8_quant_dynamic(x, self.block_k)
        gemm = torch.ops.atomc.fp8_block_gemm_shuffled if self.shuffled else torch.ops.atomc.fp8_block_gemm
        return gemm(xq, x_scale, layer.weight, layer.weight_scale_inv, self.block_n, self.block_k, bias, x.dtype)


class DequantizedFP8BlockLinearMethod(FP8BlockLinearMethod):
    """A block-FP8 checkpoint linear whose weight the model reads as a dense tensor, not through a
    GEMM (DeepSeek's kv_b_proj: absorbed MLA takes per-head views of it into torch.bmm): the fp8
    weight and its `weight_scale_inv` load as FP8BlockLinearMethod's do, then the weight is
    dequantised once into the model dtype and the scales are dropped; apply is then F.linear. Its
    inputs are never quantised, so the input features may end in a partial block too."""

    quantizes_inputs = False

    def process_weights_after_loading(self, layer):
        w = layer.weight.data
        dense = w.float() * expand_block_scale(layer.weight_scale_inv.data, self.block_n, self.block_k, *w.shape)
        _replace(layer, "weight", dense.to(layer.params_dtype))
        delattr(layer, "weight_scale_inv")

    def apply(self, layer, x, bias):
        return F.linear(x, layer.weight, bias)


def quantize_per_row(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale [N]) with one scale per output row: amax / 448."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


class OnlineFP8LinearMethod(FP8LinearMethod):
    """`--quantization fp8`: the checkpoint's bf16/fp32 weights load as they are, then each is
    quantised per output row; activations are quantised per token at run time."""

    def __init__(self, scheme: FP8Scheme):
        if not scheme.online or scheme.weight != "channel" or scheme.activation != "token":
            raise QuantConfigError(f"OnlineFP8LinearMethod cannot run {scheme.describe()}")
        self.scheme = scheme

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader):
        layer.register_parameter(
            "weight",
            _param(
                (sum(output_partition_sizes), input_size_per_partition),
                params_dtype,
                {"output_dim": 0, "input_dim": 1, "weight_loader": weight_loader},
            ),
        )

    def process_weights_after_loading(self, layer):
        weight, scale = quantize_per_row(layer.weight.data)
        _replace(layer, "weight", weight)
        layer.register_parameter("weight_scale", nn.Parameter(scale, requires_grad=False))
        to_device_fp8(layer, "weight_scale")
        self.shuffled = linear_for_aiter(layer)


def method_for(scheme: FP8Scheme, dense_weight: bool = False) -> LinearMethod | None:
    """The method of a linear the spec gives `scheme`. `dense_weight`: the model reads the layer's
    weight as a dense tensor (LinearBase.dense_weight): a block-FP8 checkpoint's is dequantised at
    load, online quantisation leaves it alone (None: keep the unquantised method), others are refused."""
    if dense_weight:
        if scheme.online:
            return None
        if scheme.weight != "block":
            raise QuantConfigError(
                f"{scheme.describe()}: a layer whose weight is read as a dense tensor (DeepSeek's kv_b_proj) "
                "is dequantised at load from block FP8 checkpoints only"
            )
        return DequantizedFP8BlockLinearMethod(scheme)
    if scheme.online:
        return OnlineFP8LinearMethod(scheme)
    if scheme.weight == "block":
        return FP8BlockLinearMethod(scheme)
    return FP8LinearMethod(scheme)
