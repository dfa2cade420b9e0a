"""`torch.ops.atomc_aiter::moe_quant`: atomc::moe_quant on AITER's fused_moe (ROCm). UNTESTED ON AMD
HARDWARE: checked only against the stand-in `aiter` of tests/kernels/fake_aiter_shuffled.py, on CPU.

Routing is atomc_aiter::moe's (`route`; an expert map through fused_moe's `expert_mask`). The experts
run on AITER only in the `_shuffled` formats (atomc/ops/moe_quant.py), which the loader writes on a
ROCm GPU with AITER for the layers AITER takes (models/quant/aiter.py); every other call goes to
ROCm's next backend (Triton runs the row-major formats and hands a `_shuffled` one to the reference).

    fp8_channel_shuffled  QuantType.per_Token, ActivationType.Silu; w1_scale [E, 2I, 1],
                          w2_scale [E, H, 1] fp32 (one per output row)
    fp8_block_shuffled    QuantType.per_128x128 (fused_moe runs it as per_1x128: 128 x 128 weight
                          blocks, activations in groups of 128), ActivationType.Silu;
                          w1_scale [E, 2I/128, H/128], w2_scale [E, H/128, I/128] fp32
    mxfp4_shuffled        QuantType.per_1x32, ActivationType.Swiglu (GPT-OSS's clamped SwiGLU),
                          gate_mode separated (gate rows, then up rows); weights as dtypes.fp4x2,
                          scales as dtypes.fp8_e8m0 [E * N, K/32]; bias1 / bias2 fp32;
                          swiglu_limit passed; x padded with zeros to the padded H, the output cut
                          back to H

The weights are passed as views tagged `is_shuffled = True`: fused_moe reads that tag to choose its
pre-shuffled kernels (aiter/fused_moe.py:747), as shuffle_weight sets it on its own output.

Activations, where AITER's math differs from the weight-only reference:
- FP8: fused_moe quantises them itself (a1_scale None: dynamic) to the weights' e4m3 dtype, per
  token (per_Token) or per 128 values (per_1x128), the input of each of the two GEMMs: W8A8, as
  atomc's FP8 linears run (fused_moe.py:765, q_dtype_a = w1.dtype). The reference and Triton keep
  them in x's dtype: the two differ by that FP8 rounding.
- MXFP4 (Swiglu): activations stay bf16/fp16 (a16w4, the reference's math) for calls of fewer than
  `_SWIGLU_MXFP4_BF16_BOUND` tokens (fused_moe.py:76, from GPTOSS_SWIGLU_MXFP4_BF16_BOUND, 256 by
  default) and are quantised to MXFP4 from there on (fused_moe.py:790), so larger batches are
  passed in slices of fewer tokens (each token's experts depend on that token alone).
"""

from __future__ import annotations

import importlib
import os

import torch
import torch.nn.functional as F

from atomc.kernels.aiter.fallback import NextBackend
from atomc.kernels.aiter.moe import local_ids_and_mask, route_block
from atomc.kernels.binding import bind_as_atomc, named_args
from atomc.ops.aiter_layout import moe_declines
from atomc.ops.moe_quant import SHUFFLED_FORMATS

FP8_QUANT_TYPES = {"fp8_channel_shuffled": "per_Token", "fp8_block_shuffled": "per_128x128"}
MXFP4_BF16_BOUND = 256  # fused_moe's default _SWIGLU_MXFP4_BF16_BOUND


def _aiter():
    import aiter

    return aiter


def _fused_moe_module():
    return importlib.import_module("aiter.fused_moe")  # a submodule `import aiter` may not load


def aiter_declines(a) -> str | None:
    """Why AITER's fused_moe cannot run this call (None when it can); `a`: the op's named arguments."""
    row_major = SHUFFLED_FORMATS.get(a.weight_format)
    if row_major is None:
        return f"weight format {a.weight_format!r}: not laid out for AITER at load"
    has_bias = a.w13_bias is not None or a.w2_bias is not None
    why = moe_declines(row_major, a.x.dtype, a.activation, a.swiglu_alpha, a.swiglu_limit, has_bias)
    if why is None and row_major != "mxfp4" and a.w13.dtype != _aiter().dtypes.fp8:
        why = f"FP8 experts in {a.w13.dtype}: this GPU's FP8 is {_aiter().dtypes.fp8}"
    return why


def _shuffled(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A view of a loader-shuffled weight in `dtype`, tagged as AITER tags shuffle_weight's output."""
    view = w.view(dtype)
    view.is_shuffled = True
    return view


def swiglu_bound() -> int:
    """The token count from which fused_moe quantises GPT-OSS's activations to MXFP4."""
    bound = getattr(_fused_moe_module(), "_SWIGLU_MXFP4_BF16_BOUND", None)
    if bound is None:  # read the way fused_moe reads it
        bound = int(os.environ.get("GPTOSS_SWIGLU_MXFP4_BF16_BOUND", str(MXFP4_BF16_BOUND)))
    return int(bound)


def experts(a, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    aiter = _aiter()
    mask = None
    if a.expert_map is not None:
        ids, mask = local_ids_and_mask(ids, a.expert_map, a.w13.shape[0])
    x = a.x.contiguous()
    call = dict(expert_mask=mask, doweight_stage1=False, a1_scale=None, a2_scale=None)  # activation scales: dynamic
    if a.weight_format == "mxfp4_shuffled":
        e, two_i = a.w13.shape[:2]
        h, padded_h = x.shape[1], a.w13.shape[2] * 2
        call.update(
            w1=_shuffled(a.w13, aiter.dtypes.fp4x2),
            w2=_shuffled(a.w2, aiter.dtypes.fp4x2),
            w1_scale=a.w13_scale.reshape(e * two_i, -1).view(aiter.dtypes.fp8_e8m0),
            w2_scale=a.w2_scale.reshape(e * a.w2.shape[1], -1).view(aiter.dtypes.fp8_e8m0),
            activation=aiter.ActivationType.Swiglu,
            quant_type=aiter.QuantType.per_1x32,
            bias1=None if a.w13_bias is None else a.w13_bias.float(),
            bias2=None if a.w2_bias is None else a.w2_bias.float(),
            swiglu_limit=a.swiglu_limit,
        )
        x = F.pad(x, (0, padded_h - h)) if padded_h > h else x
        bound = swiglu_bound()
        step = bound - 1 if bound > 1 else x.shape[0]  # a bound of 1 or less: MXFP4 activations asked for
    else:
        call.update(
            w1=_shuffled(a.w13, a.w13.dtype),
            w2=_shuffled(a.w2, a.w2.dtype),
            w1_scale=a.w13_scale.float().unsqueeze(-1) if a.weight_format == "fp8_channel_shuffled" else a.w13_scale,
            w2_scale=a.w2_scale.float().unsqueeze(-1) if a.weight_format == "fp8_channel_shuffled" else a.w2_scale,
            activation=aiter.ActivationType.Silu,
            quant_type=getattr(aiter.QuantType, FP8_QUANT_TYPES[a.weight_format]),
        )
        h, step = x.shape[1], x.shape[0]
    fused_moe = _fused_moe_module().fused_moe
    parts = [
        fused_moe(hidden_states=x[i : i + step], topk_weight=weights[i : i + step], topk_ids=ids[i : i + step], **call)
        for i in range(0, x.shape[0], step)
    ]
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out[:, :h].contiguous() if out.shape[1] > h else out


# ROCm's next backend for what AITER declines (fallback.py)
next_backend = NextBackend("atomc_aiter::moe_quant")
set_next_backend = next_backend.set


@bind_as_atomc("atomc_aiter", "moe_quant")
def moe_quant(*args) -> torch.Tensor:
    a = named_args("moe_quant", args)  # atomc::moe_quant's arguments, its defaults filled in
    if aiter_declines(a) is not None:
        return next_backend(*args)
    if a.x.shape[0] == 0:
        return torch.empty_like(a.x)
    weights, ids = route_block(a)
    return experts(a, weights, ids)
