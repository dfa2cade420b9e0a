"""Scatter this step's K/V rows into NHD pages: slot = page * page_size + offset; slot -1 is padding.

FP8 pages (e4m3, `--kv-cache-dtype fp8`): each value is stored as x / scale (the layer's k or v
scale), saturated at ±448 and rounded to nearest e4m3, as `atomc.ops.attention.quantize_kv` does.
`quantize_kv_value` is that step, shared with the fused RoPE + KV-write kernel (rope.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomc.kernels.triton.fp8_quant import ROUND_IN_FP32, _round_to_e4m3_grid
from atomc.kv_spec import FP8_KV_DTYPE


@triton.jit
def quantize_kv_value(x, scale_ptr, dtype: tl.constexpr, FP8: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
    """x as the cache stores it: a cast, or (FP8) x / scale saturated and rounded to e4m3. Under
    the interpreter the rounding is done in fp32 first (its own cast mis-rounds: fp8_quant.py)."""
    if FP8:
        y = tl.minimum(tl.maximum(x.to(tl.float32) / tl.load(scale_ptr), -448.0), 448.0)
        if ROUND_IN_FP32:
            y = _round_to_e4m3_grid(y)
        return y.to(dtype)
    return x.to(dtype)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, FP8: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    page = slot // PAGE
    off = slot % PAGE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=mask)
    kc = k_cache_ptr + page * stride_kcb + off * stride_kcs + h * stride_kch + d
    vc = v_cache_ptr + page * stride_vcb + off * stride_vcs + h * stride_vch + d
    tl.store(kc, quantize_kv_value(k, k_scale_ptr, k_cache_ptr.dtype.element_ty, FP8, ROUND_IN_FP32), mask=mask)
    tl.store(vc, quantize_kv_value(v, v_scale_ptr, v_cache_ptr.dtype.element_ty, FP8, ROUND_IN_FP32), mask=mask)


def kv_scale_args(k_cache: torch.Tensor, kv_scales, fallback: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(k_scale, v_scale, fp8) kernel arguments: the scales for FP8 pages (required), else
    `fallback` twice (an unused pointer)."""
    if k_cache.dtype != FP8_KV_DTYPE:
        return fallback, fallback, False
    if kv_scales is None:
        raise ValueError("an FP8 (e4m3) KV cache needs its layer's (k_scale, v_scale)")
    k_scale, v_scale = kv_scales
    assert k_scale.dtype == v_scale.dtype == torch.float32 and k_scale.numel() == v_scale.numel() == 1
    return k_scale, v_scale, True


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """k/v [T, Hkv, D] (T >= slot_mapping.numel()); caches [blocks, page, Hkv, D]; `kv_scales`
    (k_scale, v_scale) fp32 [1] for FP8 pages."""
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    _, page, num_heads, head_dim = k_cache.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    k_scale, v_scale, fp8 = kv_scale_args(k_cache, kv_scales, slot_mapping)
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim), PAGE=page,
        FP8=fp8, ROUND_IN_FP32=fp8 and ROUND_IN_FP32, num_warps=4,
    )  # fmt: skip
