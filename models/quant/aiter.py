"""Quantised weights laid out once at load for AITER's pre-shuffled kernels, on a ROCm GPU that runs
AITER (atomc.platforms.uses_aiter) and nowhere else: CPU, CUDA and ROCm without AITER load exactly
as before. UNTESTED ON AMD HARDWARE: the layouts are AITER's as its source writes them
(atomc/ops/aiter_layout.py), checked only against the CPU stand-in.

`linear_for_aiter(layer, block)` runs at the end of an FP8 linear method's
process_weights_after_loading (models/quant/fp8.py), after the move to the GPU's e4m3: where AITER's
pre-shuffled GEMMs take the layer it rewrites `weight` [N, K] in shuffle_weight's (16, 16) order
(scales unchanged) and says so; the method then emits atomc::fp8_gemm_shuffled /
fp8_block_gemm_shuffled (atomc/ops/fp8_shuffled.py) instead of the row-major GEMMs, so the graph
names what the weight holds. Taken: fp16/bf16 models (the GEMMs write only those), N % 16 == 0 and
K % 32 == 0 (shuffle_weight asserts it; ATOM checks the same before shuffling, its
_can_use_a8w8_preshuffle), and for blocks 128 x 128 ones over whole 128-groups of K. Other layers
keep row-major weights and the row-major GEMMs (gemm_a8w8 / gemm_a8w8_blockscale on AITER).

`experts_for_aiter(layer, method)` runs at the end of an MoE method's process_weights_after_loading.
When AITER's fused_moe takes the layer (atomc.ops.aiter_layout.moe_declines: dtype, activation,
biases; and the shapes below), it rewrites the four expert tensors in place of the row-major ones
and sets the method's `weight_format` to the `_shuffled` twin (atomc/ops/moe_quant.py), so the
traced graph names the layout its weights hold; a layer AITER does not take keeps its row-major
format, and its graph runs on ROCm's next backend (Triton), which reads that.

- FP8 ("fp8_channel", "fp8_block"): on MI300 moved to float8_e4m3fnuz first (fn_to_fnuz: same bits,
  scales doubled), AITER's FP8 there; then each expert's [N, K] weight through shuffle_weight's
  (16, 16) order; scales unchanged. Taken when N % 16 == 0 and K % 32 == 0 for both weights
  (shuffle_weight asserts it) and, for blocks, H and I whole 128-blocks (fused_moe's per_1x128
  kernels read whole blocks: its torch reference views the scales so).
- MXFP4 ("mxfp4"): H and I padded with zeros to multiples of 256 (ATOM pads GPT-OSS's 2880 to 3072
  the same way; scales of the padding 127, i.e. 2^0), the packed weights shuffled as above, the e8m0
  scales through shuffle_scale's order over [E * N, K/32], the biases padded and made fp32 (AITER
  takes fp32 expert biases). Not on MI300 (no FP4 there: ATOM runs Triton's MXFP4 MoE on gfx94x).
"""

from __future__ import annotations

import torch
from torch import nn

from atomc import platforms
from atomc.ops.aiter_layout import HALF_DTYPES, MXFP4_PAD, fits_16x16, moe_declines, shuffle_16x16, shuffle_e8m0
from atomc.ops.fp8 import FNUZ_DTYPE, fn_to_fnuz
from atomc.ops.moe_quant import E8M0_BIAS, FP8_BLOCK


def _set(layer: nn.Module, name: str, value: torch.Tensor) -> None:
    setattr(layer, name, nn.Parameter(value, requires_grad=False))


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def experts_decline(layer: nn.Module, weight_format: str) -> str | None:
    """Why `layer`'s experts stay row-major on a GPU that runs AITER (None: they are laid out for it)."""
    s = layer.spec
    why = moe_declines(weight_format, layer.params_dtype, s.activation, s.swiglu_alpha, s.swiglu_limit,
                       layer.w13_bias is not None or layer.w2_bias is not None)  # fmt: skip
    if why is not None:
        return why
    i, h = layer.local_intermediate, layer.hidden_size
    device = next(layer.parameters()).device
    if weight_format == "mxfp4":
        return "MXFP4 experts on MI300 (no FP4 there)" if platforms.fp8_dtype(device) == FNUZ_DTYPE else None
    if not (fits_16x16(2 * i, h) and fits_16x16(h, i)):
        return f"expert weights [{2 * i}, {h}] / [{h}, {i}]: shuffle_weight needs N % 16 == 0 and K % 32 == 0"
    if weight_format == "fp8_block" and (h % FP8_BLOCK or i % FP8_BLOCK):
        return f"block FP8 experts with H {h}, I {i}: AITER's per_1x128 kernels take whole 128-blocks"
    return None


def experts_for_aiter(layer: nn.Module, method) -> bool:
    """Lay `layer`'s experts out for AITER when its device runs AITER and AITER takes them (module
    docstring); True when it did, and `method.weight_format` is then the `_shuffled` format."""
    w13_name, s13_name, w2_name, s2_name = method.params
    device = getattr(layer, w13_name).device
    if not platforms.uses_aiter(device) or experts_decline(layer, method.weight_format) is not None:
        return False
    w13, s13, w2, s2 = (getattr(layer, n).data for n in method.params)
    if method.weight_format == "mxfp4":
        w13, s13, w2, s2 = _pad_mxfp4(layer, w13, s13, w2, s2)
        e, n13, n2 = w13.shape[0], w13.shape[1], w2.shape[1]
        s13 = shuffle_e8m0(s13.reshape(e * n13, -1)).view(s13.shape)
        s2 = shuffle_e8m0(s2.reshape(e * n2, -1)).view(s2.shape)
    elif platforms.fp8_dtype(device) == FNUZ_DTYPE:  # AITER's FP8 on MI300
        (w13, s13), (w2, s2) = fn_to_fnuz(w13, s13), fn_to_fnuz(w2, s2)
    for name, value in zip(method.params, (shuffle_16x16(w13), s13, shuffle_16x16(w2), s2), strict=True):
        _set(layer, name, value.contiguous())
    method.weight_format = f"{method.weight_format}_shuffled"
    return True


def _pad_mxfp4(layer, w13, s13, w2, s2):
    """Zero experts past H and I (scales 2^0) up to multiples of MXFP4_PAD; biases padded, fp32."""
    e, i, h = w13.shape[0], layer.local_intermediate, layer.hidden_size
    ip, hp = _round_up(i, MXFP4_PAD), _round_up(h, MXFP4_PAD)
    if layer.w13_bias is not None:
        b13 = layer.w13_bias.data.new_zeros(e, 2 * ip, dtype=torch.float32)
        b13[:, :i], b13[:, ip : ip + i] = layer.w13_bias.data[:, :i], layer.w13_bias.data[:, i:]
        _set(layer, "w13_bias", b13)
    if layer.w2_bias is not None:
        b2 = layer.w2_bias.data.new_zeros(e, hp, dtype=torch.float32)
        b2[:, :h] = layer.w2_bias.data
        _set(layer, "w2_bias", b2)
    if (ip, hp) == (i, h):
        return w13, s13, w2, s2

    def pad(t, rows, cols, fill, halves):
        out = t.new_full((e, rows, cols), fill)
        if halves:  # gate rows to [0, I), up rows to [I_pad, I_pad + I)
            out[:, :i, : t.shape[2]], out[:, ip : ip + i, : t.shape[2]] = t[:, :i], t[:, i:]
        else:
            out[:, : t.shape[1], : t.shape[2]] = t
        return out

    return (
        pad(w13, 2 * ip, hp // 2, 0, True),
        pad(s13, 2 * ip, hp // 32, E8M0_BIAS, True),
        pad(w2, hp, ip // 2, 0, False),
        pad(s2, hp, ip // 32, E8M0_BIAS, False),
    )


def linear_declines(layer: nn.Module, block: tuple[int, int] | None) -> str | None:
    """Why an FP8 linear's weight stays row-major on a GPU that runs AITER (None: it is shuffled)."""
    n, k = layer.weight.shape
    if layer.params_dtype not in HALF_DTYPES:
        return f"dtype {layer.params_dtype}: AITER's FP8 GEMMs write fp16/bf16"
    if not fits_16x16(n, k):
        return f"weight [{n}, {k}]: shuffle_weight needs N % 16 == 0 and K % 32 == 0"
    if block is not None and (tuple(block) != (FP8_BLOCK, FP8_BLOCK) or k % FP8_BLOCK):
        return f"blocks {tuple(block)} over K {k}: gemm_a8w8_blockscale_bpreshuffle takes 128 x 128 over whole groups"
    return None


def linear_for_aiter(layer: nn.Module, block: tuple[int, int] | None = None) -> bool:
    """Shuffle `layer`'s FP8 weight for AITER when its device runs AITER and the GEMM takes it (module
    docstring); True when it did (the linear must then emit the `_shuffled` GEMM)."""
    if not platforms.uses_aiter(layer.weight.device) or linear_declines(layer, block) is not None:
        return False
    _set(layer, "weight", shuffle_16x16(layer.weight.data))
    return True
