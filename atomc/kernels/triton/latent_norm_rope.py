"""atomc::mla_latent_norm_rope in one launch: RMSNorm of the MLA latent c_kv, and RoPE of the shared
rope key k_pe and of every head's q_pe, optionally de-interleaving the rope dims as it loads them.

Grid (tokens, q head blocks + 1): the programs of axis 1 below the last each rotate BLOCK_H heads of
one token's q_pe; the last normalises that token's c_kv row and rotates its k_pe. Splitting q over
head blocks keeps each program's tile small at DeepSeek-V3's 128 heads and gives a batch-1 decode
step more than one program. Inputs are read through their strides (the split of the projection
and the rope slice of q are views), outputs are new contiguous tensors.

De-interleaving: pair i of an interleaved checkpoint is dims (2i, 2i+1); rotate-half pairs (i, i +
R/2). Loading x1 = x[2i], x2 = x[2i+1] and storing the rotation at i and i + R/2 is the gather and
the rotation in one pass (the stored order is the evens then the odds, as the model's gather).

Rounding follows the references: the table is rounded to the tensor's dtype (atomc::rope casts it),
the rotation is computed in fp32 and rounded once; the norm takes fp32 statistics, rounds to the
input dtype, then multiplies by the weight (atomc::rms_norm).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomc.kernels.triton import pdl
from atomc.kernels.triton.pdl import after_producer


@triton.jit
def _rotate(x_ptr, out_ptr, stride_h, out_stride_h, cos, sin, h, d, mask,
            HALF: tl.constexpr, INTERLEAVED: tl.constexpr):  # fmt: skip
    if INTERLEAVED:
        src = x_ptr + h * stride_h + 2 * d
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + 1, mask=mask, other=0.0).to(tl.float32)
    else:
        src = x_ptr + h * stride_h + d
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + h * out_stride_h + d
    tl.store(dst, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _latent_norm_rope_kernel(
    pos_ptr, q_ptr, k_ptr, c_ptr, w_ptr, cs_ptr, q_out_ptr, k_out_ptr, c_out_ptr,
    stride_qt, stride_qh, stride_kt, stride_ct, stride_cs, eps,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, LORA: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_L: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    after_producer(PDL)  # pdl.py
    t = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    cs = cs_ptr + pos * stride_cs + d
    dtype = q_out_ptr.dtype.element_ty
    cos = tl.load(cs, mask=d < HALF, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(cs + HALF, mask=d < HALF, other=0.0).to(dtype).to(tl.float32)
    # the branches name their head tiles apart: Triton's compiler (not its interpreter) refuses a
    # name bound to a [BLOCK_H, 1] tile in one branch and a [1, 1] tile in the other
    if block * BLOCK_H < NUM_HEADS:
        q_heads = block * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
        q_mask = (q_heads < NUM_HEADS) & (d < HALF)
        _rotate(q_ptr + t * stride_qt, q_out_ptr + t * NUM_HEADS * 2 * HALF, stride_qh, 2 * HALF,
                cos, sin, q_heads, d, q_mask, HALF, INTERLEAVED)  # fmt: skip
    else:
        k_head = tl.arange(0, 1)[:, None]
        _rotate(k_ptr + t * stride_kt, k_out_ptr + t * 2 * HALF, 0, 0, cos, sin, k_head, d, d < HALF, HALF,
                INTERLEAVED)  # fmt: skip
        cols = tl.arange(0, BLOCK_L)
        cmask = cols < LORA
        x = tl.load(c_ptr + t * stride_ct + cols, mask=cmask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 0) / LORA + eps)
        y = (x * rstd).to(c_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(c_out_ptr + t * LORA + cols, (y * w).to(c_out_ptr.dtype.element_ty), mask=cmask)


def _last_dim_dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def mla_latent_norm_rope(
    positions: torch.Tensor,
    q_pe: torch.Tensor,
    k_pe: torch.Tensor,
    c_kv: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q_pe [T, H, R], k_pe [T, 1, R] (or [T, R]), c_kv [T, L] (any row strides) -> (rotated q_pe,
    rotated k_pe, weight * normalise(c_kv)), new contiguous tensors of the inputs' shapes."""
    tokens, heads, rope_dim = q_pe.shape
    lora = c_kv.shape[-1]
    assert rope_dim % 2 == 0 and k_pe.shape[0] == c_kv.shape[0] == tokens and k_pe.numel() == tokens * rope_dim
    assert weight.shape == (lora,) and cos_sin_cache.shape[-1] == rope_dim
    q_pe, k_pe, c_kv = _last_dim_dense(q_pe), _last_dim_dense(k_pe), _last_dim_dense(c_kv)
    weight, cos_sin_cache = weight.contiguous(), _last_dim_dense(cos_sin_cache)
    q_out = torch.empty(q_pe.shape, dtype=q_pe.dtype, device=q_pe.device)
    k_out = torch.empty(k_pe.shape, dtype=k_pe.dtype, device=k_pe.device)
    c_out = torch.empty(c_kv.shape, dtype=torch.promote_types(c_kv.dtype, weight.dtype), device=c_kv.device)
    if tokens == 0:
        return q_out, k_out, c_out
    half = rope_dim // 2
    block_h = min(triton.next_power_of_2(heads), 16)
    grid = (tokens, triton.cdiv(heads, block_h) + 1)
    _latent_norm_rope_kernel[grid](
        positions, q_pe, k_pe, c_kv, weight, cos_sin_cache, q_out, k_out, c_out,
        q_pe.stride(0), q_pe.stride(1), k_pe.stride(0), c_kv.stride(0), cos_sin_cache.stride(0), eps,
        NUM_HEADS=heads, HALF=half, LORA=lora, BLOCK_H=block_h, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_L=triton.next_power_of_2(lora), INTERLEAVED=interleaved, num_warps=4, **pdl.launch(q_pe),
    )  # fmt: skip
    return q_out, k_out, c_out
