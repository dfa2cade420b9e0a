"""`atomc::moe_quant`: the MoE block of atomc::moe with quantised expert weights.

The same routing and expert math as atomc/ops/moe.py; only the two stacked weights differ, each
given as (packed weight, scale) in the layout `weight_format` names:

- "mxfp4" (OCP microscaling FP4, as GPT-OSS ships its experts): `w13` uint8 [E, 2I, H/2] and `w2`
  uint8 [E, H, I/2], two e2m1 values a byte along the input dim, the even-numbered value in the low
  nibble; `w13_scale` uint8 [E, 2I, H/32], `w2_scale` uint8 [E, H, I/32], one e8m0 exponent (bias
  127) per 32 consecutive input values. Value = e2m1(nibble) * 2^(scale - 127).

- "fp8_channel": `w13` float8_e4m3fn [E, 2I, H], `w2` [E, H, I]; `w13_scale` fp32 [E, 2I],
  `w2_scale` [E, H], one per output row. Value = fp8 * scale.
- "fp8_block": the same fp8 weights, `w13_scale` fp32 [E, ceil(2I/128), ceil(H/128)] and `w2_scale`
  [E, ceil(H/128), ceil(I/128)], one per 128x128 weight block (DeepSeek-V3/R1's and Qwen3-FP8's
  `weight_scale_inv`, stacked per expert). Value = fp8 * the block's scale.
FP8 experts run weight-only here (activations stay in x's dtype): the weights dequantised, as the
MXFP4 ones are; no activation quantisation.

Each format has a `_shuffled` twin ("mxfp4_shuffled", "fp8_channel_shuffled", "fp8_block_shuffled"):
the same values in the layouts AITER's fused_moe reads (atomc/ops/aiter_layout.py), which the loader
writes once on a ROCm GPU that runs AITER (models/quant/aiter.py) and only there:
- the weights in shuffle_weight(layout=(16, 16)) order, same shapes; FP8 ones may be
  float8_e4m3fnuz (MI300: same bits, scales doubled, atomc.ops.fp8.fn_to_fnuz);
- "mxfp4_shuffled" also: each scale tensor in shuffle_scale's (e8m0_shuffle) order over its rows
  [E * N, K/32], and H and I padded with zero weights (scales 2^0) to multiples of 256, so w13 is
  [E, 2 * I_pad, H_pad/2] (gate rows, zeros, up rows, zeros) and w2 [E, H_pad, I_pad/2]; the biases
  are padded to match (and fp32, as AITER takes them). x stays [T, H]: the padded experts read zeros
  past H and write outputs past H that are dropped, and padded intermediate rows (zero weights, zero
  biases) give zero activations for both activations, so the values are the unpadded experts'.
The reference reads them back through the inverse layouts; the Triton kernels read only the
row-major formats (their binding hands a `_shuffled` call to this reference).

Rows are FusedMoE's: w13 holds each expert's gate rows then its up rows. The reference dequantises
the experts to x's dtype and runs `experts_reference` (every MXFP4 value is exact in bf16/fp16/fp32
within their exponent ranges); kernels dequantise in registers (atomc/kernels/triton/moe_quant.py).
One op with a format argument, not one op per format, so FP8 experts join it without a new schema.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atomc.ops.aiter_layout import FP8_E4M3, unshuffle_16x16, unshuffle_e8m0
from atomc.ops.moe import append_shared_experts, check_shared_experts, experts_reference, select_experts

WEIGHT_FORMATS = ("mxfp4", "fp8_channel", "fp8_block")  # row-major: what every backend reads
SHUFFLED_FORMATS = {f"{f}_shuffled": f for f in WEIGHT_FORMATS}  # AITER's layouts -> the values' format
ALL_FORMATS = (*WEIGHT_FORMATS, *SHUFFLED_FORMATS)
FP8_BLOCK = 128  # the fp8_block format's weight block (rows and columns)
MXFP4_GROUP = 32  # values per e8m0 scale
E8M0_BIAS = 127
# e2m1 code -> value: bit 3 the sign, bits 2-1 the exponent (bias 1), bit 0 the mantissa
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., K/2], scales uint8 [..., K/32] -> [..., K] in `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    k = blocks.shape[-1] * 2
    if scales.shape != (*blocks.shape[:-1], k // MXFP4_GROUP) or k % MXFP4_GROUP:
        raise ValueError(
            f"MXFP4 scales {tuple(scales.shape)} do not fit blocks {tuple(blocks.shape)} (one scale per 32 values)"
        )
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)
    exponent = scales.to(torch.int32) - E8M0_BIAS
    groups = values.unflatten(-1, (k // MXFP4_GROUP, MXFP4_GROUP))
    return torch.ldexp(groups, exponent[..., None].float()).flatten(-2).to(dtype)


def dequantize_fp8_experts(w: torch.Tensor, scale: torch.Tensor, block: bool, dtype: torch.dtype) -> torch.Tensor:
    """fp8 [E, N, K] with per-row scales [E, N] or 128x128 block scales [E, ceil(N/128), ceil(K/128)]."""
    e, n, k = w.shape
    want = (e, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)) if block else (e, n)
    if w.dtype not in FP8_E4M3 or tuple(scale.shape) != want:
        raise ValueError(
            f"fp8 experts: weight {w.dtype} {tuple(w.shape)} with scale {tuple(scale.shape)} "
            f"(want float8_e4m3fn or float8_e4m3fnuz and scale {want})"
        )
    if block:
        scale = scale.repeat_interleave(FP8_BLOCK, 1)[:, :n].repeat_interleave(FP8_BLOCK, 2)[:, :, :k]
    else:
        scale = scale[..., None]
    return (w.float() * scale.float()).to(dtype)


def unshuffle_experts(w: torch.Tensor, scale: torch.Tensor, weight_format: str):
    """(w, scale) of a `_shuffled` format -> (w, scale) of its row-major format (module docstring)."""
    w = unshuffle_16x16(w)
    if weight_format == "mxfp4_shuffled":
        e, n = w.shape[:2]
        scale = unshuffle_e8m0(scale.reshape(e * n, -1)).view(e, n, -1)
    return w, scale


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor, weight_format: str, dtype: torch.dtype) -> torch.Tensor:
    """A stacked quantised expert weight -> [E, N, K] in `dtype` (padded ones with their padding)."""
    if weight_format in SHUFFLED_FORMATS:
        w, scale = unshuffle_experts(w, scale, weight_format)
        weight_format = SHUFFLED_FORMATS[weight_format]
    if weight_format == "mxfp4":
        return dequantize_mxfp4(w, scale, dtype)
    if weight_format in ("fp8_channel", "fp8_block"):
        return dequantize_fp8_experts(w, scale, weight_format == "fp8_block", dtype)
    raise ValueError(f"MoE weight format {weight_format!r} is not supported (supported: {', '.join(ALL_FORMATS)})")


@torch.library.custom_op("atomc::moe_quant", mutates_args=())
def moe_quant(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    expert_map: torch.Tensor | None,
    correction_bias: torch.Tensor | None,
    top_k: int,
    weight_format: str,
    scoring: str = "softmax",
    renormalize: bool = True,
    num_expert_group: int = 0,
    topk_group: int = 0,
    routed_scaling_factor: float = 1.0,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    num_shared_experts: int = 0,
) -> torch.Tensor:
    """x [T, H] -> [T, H]. Reference: dequantise every expert, then atomc::moe's reference body
    (shared experts as atomc::moe takes them)."""
    weights, ids = select_experts(
        router_logits, top_k, scoring, renormalize, correction_bias, num_expert_group, topk_group,
        routed_scaling_factor,
    )  # fmt: skip
    check_shared_experts(num_shared_experts, expert_map)
    weights, ids = append_shared_experts(weights, ids, num_shared_experts, router_logits.shape[-1])
    w13_dense = dequantize_experts(w13, w13_scale, weight_format, x.dtype)
    w2_dense = dequantize_experts(w2, w2_scale, weight_format, x.dtype)
    h, padded = x.shape[1], w13_dense.shape[2]  # padded past H: "mxfp4_shuffled" (module docstring)
    w13_bias, w2_bias = (None if b is None else b.to(x.dtype) for b in (w13_bias, w2_bias))
    out = experts_reference(F.pad(x, (0, padded - h)) if padded > h else x, weights, ids, w13_dense, w2_dense,
                            w13_bias, w2_bias, expert_map, activation, swiglu_alpha, swiglu_limit)  # fmt: skip
    return out[:, :h].contiguous() if padded > h else out


@moe_quant.register_fake
def _(x, router_logits, w13, w13_scale, w2, w2_scale, *args, **kwargs):
    return torch.empty_like(x)
