"""The MLA latent write: this step's rows [c_kv | k_pe] (straight from their own tensors, no
concatenation) scattered into the paged latent cache [blocks, page, 1, kv_lora + rope] that
mla_attention.py reads. FP8 pages (`--kv-cache-dtype fp8`) hold the rows / kv_scale in e4m3, one
scale a layer, quantised as the MHA write does (`quantize_kv_value`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomc.kernels.triton import pdl
from atomc.kernels.triton.fp8_quant import ROUND_IN_FP32
from atomc.kernels.triton.kv_cache_write import quantize_kv_value
from atomc.kernels.triton.pdl import after_producer
from atomc.kv_spec import FP8_KV_DTYPE


def latent_scale_arg(latent_cache: torch.Tensor, kv_scale, fallback: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(kv_scale, fp8) kernel arguments: the scale for FP8 pages (required), else `fallback` (an
    unused pointer)."""
    if latent_cache.dtype != FP8_KV_DTYPE:
        return fallback, False
    if kv_scale is None:
        raise ValueError("an FP8 (e4m3) latent cache needs its layer's kv_scale")
    assert kv_scale.dtype == torch.float32 and kv_scale.numel() == 1
    return kv_scale, True


@triton.jit
def _write_latent_kernel(
    c_ptr, r_ptr, cache_ptr, slot_ptr, kv_scale_ptr,
    stride_ct, stride_rt, stride_cb, stride_cs,
    KV_LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE: tl.constexpr, FP8: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    after_producer(PDL)  # pdl.py
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding
        return
    row = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    c = tl.load(c_ptr + t.to(tl.int64) * stride_ct + offs_c, mask=offs_c < KV_LORA)
    r = tl.load(r_ptr + t.to(tl.int64) * stride_rt + offs_r, mask=offs_r < ROPE)
    dtype = cache_ptr.dtype.element_ty
    tl.store(row + offs_c, quantize_kv_value(c, kv_scale_ptr, dtype, FP8, ROUND_IN_FP32), mask=offs_c < KV_LORA)
    tl.store(row + KV_LORA + offs_r, quantize_kv_value(r, kv_scale_ptr, dtype, FP8, ROUND_IN_FP32), mask=offs_r < ROPE)


def write_latent_cache(
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """c_kv [T, kv_lora] and k_pe [T, rope] (T >= slot_mapping.numel()) -> their slots' latent rows
    [c_kv | k_pe] in pages [blocks, page, 1, kv_lora + rope]; slot -1 writes nothing. `kv_scale`
    fp32 [1] for FP8 pages (both parts stored / kv_scale, as atomc.ops.mla.write_latent_cache)."""
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    _, page, _, latent_dim = latent_cache.shape
    kv_lora, rope = c_kv.shape[-1], k_pe.shape[-1]
    assert kv_lora + rope == latent_dim and c_kv.stride(-1) == 1 and k_pe.stride(-1) == 1
    assert latent_cache.stride(-1) == 1
    kv_scale, fp8 = latent_scale_arg(latent_cache, kv_scale, slot_mapping)
    _write_latent_kernel[(num_tokens,)](
        c_kv, k_pe, latent_cache, slot_mapping, kv_scale,
        c_kv.stride(0), k_pe.stride(0), latent_cache.stride(0), latent_cache.stride(1),
        KV_LORA=kv_lora, ROPE=rope, BLOCK_C=triton.next_power_of_2(kv_lora),
        BLOCK_R=triton.next_power_of_2(rope), PAGE=page, FP8=fp8, ROUND_IN_FP32=fp8 and ROUND_IN_FP32,
        num_warps=4, **pdl.launch(c_kv),
    )  # fmt: skip
