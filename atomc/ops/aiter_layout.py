"""The weight layouts AITER's pre-shuffled kernels read, as plain torch permutations with their
inverses, and which shapes atomc lays out that way.

On a ROCm GPU that runs AITER (atomc.platforms.uses_aiter) the loader moves quantised weights into
these layouts once (models/quant/aiter.py); the graph then says so (the `*_shuffled` MoE weight
formats of atomc/ops/moe_quant.py, the `fp8_*gemm_shuffled` ops of atomc/ops/fp8_shuffled.py), the
AITER bindings hand the tensors to AITER as they are, and the reference bodies read them back
through the inverses here, so an eager run or a call AITER declines computes the same values.
UNTESTED ON AMD HARDWARE: the permutations are AITER's as its source writes them (below), checked
against a copy of that source in the CPU stand-in (tests/kernels/fake_aiter_shuffled.py).

- `shuffle_16x16(w)`: aiter.ops.shuffle.shuffle_weight(w, layout=(16, 16)) for a one-byte dtype
  (e4m3, or packed e2m1 pairs viewed as bytes): [..., N, K] viewed as (N/16, 16, K/32, 2, 16) and
  stored as (N/16, K/32, 2, 16, 16), i.e. each 16-row x 32-byte tile as two 16 x 16 halves. It
  needs N % 16 == 0 and K % 32 == 0 (bytes), as shuffle_weight asserts.
- `shuffle_e8m0(s)`: aiter.ops.shuffle.shuffle_scale (fp4_utils.e8m0_shuffle) for [R, C] e8m0
  scales: (R/32, 2, 16, C/8, 2, 4) stored as (R/32, C/8, 4, 16, 2, 2). AITER pads R to a multiple
  of 256 and C to one of 8 first; atomc only shuffles scales that need no padding.
"""

from __future__ import annotations

import torch

SHUFFLE_ROWS, SHUFFLE_BYTES = 16, 32  # shuffle_weight(layout=(16, 16)): N % 16, K % 32 bytes
E8M0_ROWS, E8M0_COLS = 256, 8  # shuffle_scale pads rows to 256, columns to 8
FP8_E4M3 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def fits_16x16(n: int, k_bytes: int) -> bool:
    """Whether shuffle_weight(layout=(16, 16)) takes an [N, K] weight of K bytes a row as it is."""
    return n % SHUFFLE_ROWS == 0 and k_bytes % SHUFFLE_BYTES == 0


def _bytes(w: torch.Tensor) -> torch.Tensor:
    if w.element_size() != 1:
        raise ValueError(f"the 16x16 shuffle here is for one-byte dtypes, got {w.dtype}")
    return w.contiguous().view(torch.uint8)


def shuffle_16x16(w: torch.Tensor) -> torch.Tensor:
    """[..., N, K] one-byte values -> the same shape and dtype in shuffle_weight's (16, 16) order."""
    *lead, n, k = w.shape
    if not fits_16x16(n, k):
        raise ValueError(f"shuffle_weight(layout=(16, 16)) needs N % 16 == 0 and K % 32 == 0, got [{n}, {k}]")
    b = _bytes(w).view(-1, n // 16, 16, k // 32, 2, 16).permute(0, 1, 3, 4, 2, 5)
    return b.contiguous().view(*lead, n, k).view(w.dtype)


def unshuffle_16x16(w: torch.Tensor) -> torch.Tensor:
    """The inverse of `shuffle_16x16`: row-major [..., N, K] again."""
    *lead, n, k = w.shape
    if not fits_16x16(n, k):
        raise ValueError(f"not a shuffle_weight(layout=(16, 16)) layout: [{n}, {k}]")
    b = _bytes(w).view(-1, n // 16, k // 32, 2, 16, 16).permute(0, 1, 4, 2, 3, 5)
    return b.contiguous().view(*lead, n, k).view(w.dtype)


def fits_e8m0(rows: int, cols: int) -> bool:
    """Whether shuffle_scale takes [rows, cols] e8m0 scales without padding them."""
    return rows % E8M0_ROWS == 0 and cols % E8M0_COLS == 0


def shuffle_e8m0(s: torch.Tensor) -> torch.Tensor:
    """[R, C] one-byte scales -> the same shape in shuffle_scale's order (no padding: module docstring)."""
    r, c = s.shape
    if not fits_e8m0(r, c):
        raise ValueError(f"atomc shuffles e8m0 scales of R % 256 == 0 and C % 8 == 0 only, got [{r}, {c}]")
    b = _bytes(s).view(r // 32, 2, 16, c // 8, 2, 4).permute(0, 3, 5, 2, 4, 1)
    return b.contiguous().view(r, c).view(s.dtype)


def unshuffle_e8m0(s: torch.Tensor) -> torch.Tensor:
    """The inverse of `shuffle_e8m0`."""
    r, c = s.shape
    if not fits_e8m0(r, c):
        raise ValueError(f"not a shuffle_scale layout: [{r}, {c}]")
    b = _bytes(s).view(r // 32, c // 8, 4, 16, 2, 2).permute(0, 5, 3, 1, 4, 2)
    return b.contiguous().view(r, c).view(s.dtype)


# ---- which MoE experts AITER's fused_moe runs (the loader lays out only these) ----

HALF_DTYPES = (torch.float16, torch.bfloat16)  # fused_moe asserts its output dtype is one of them
# AITER's Swiglu is GPT-OSS's clamped SwiGLU with alpha 1.702 and limit 7.0 (aiter/fused_moe.py's
# torch reference `swiglu`; its activation kernels hard-code both)
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
MXFP4_PAD = 256  # H and I of MXFP4 experts laid out for AITER: padded to multiples of 256, as ATOM pads


def moe_declines(weight_format: str, dtype: torch.dtype, activation: str, alpha: float, limit: float,
                 has_bias: bool) -> str | None:  # fmt: skip
    """Why AITER's fused_moe cannot run experts of row-major `weight_format` as atomc::moe_quant asks
    (None when it can): the part of the answer that does not depend on shapes. The loader asks before
    laying experts out for AITER; the AITER binding asks again before each call."""
    if dtype not in HALF_DTYPES:
        return f"dtype {dtype}: fused_moe takes fp16/bf16"
    if weight_format == "mxfp4":
        if activation != "swiglu_oai" or (alpha, limit) != (SWIGLU_ALPHA, SWIGLU_LIMIT):
            return (
                f"MXFP4 experts with {activation!r} (alpha {alpha}, limit {limit}): AITER keeps activations "
                "unquantised only for GPT-OSS's SwiGLU (alpha 1.702, limit 7.0)"
            )
        return None
    if weight_format not in ("fp8_channel", "fp8_block"):
        return f"weight format {weight_format!r}"
    if activation != "silu":
        return f"FP8 experts with {activation!r}: AITER wires its Swiglu (and expert biases) for MXFP4 experts"
    if has_bias:
        return "FP8 experts with biases: fused_moe passes expert biases to its MXFP4 kernels only"
    return None
