"""Neox (rotate-half) RoPE on q and k, in place or into given outputs, optionally fused with the
KV-cache write and, before the rotation, with a per-head RMSNorm of q and k (Qwen3's q_norm / k_norm).

cos_sin_cache [max_pos, D] fp32 = cat(cos, sin) over D/2 each (models.layers.rotary.RotaryEmbedding).
Fusing the write saves re-reading the rotated k and v from memory in a second kernel; fusing the
norms saves two more kernels per layer (each a few µs at batch 1). SPLIT_QK (off until timed): two
programs a token, one rotating q, the other k and writing the cache (at batch 1 one program does all
three in turn: 3.6 µs a layer on the H100, docs/performance.md section 18). FP8 pages are written as
kv_cache_write.py writes them (x / scale, saturated, rounded to e4m3), from the rotated k in fp32.
q and k may have any token and head strides (the q/k slices of the fused qkv GEMM's output), and
the rotated values may go to other tensors than q and k: the functional ops then need no copy of
q and k to rotate in place (two device copies a layer otherwise).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomc.kernels.triton import pdl
from atomc.kernels.triton.fp8_quant import ROUND_IN_FP32
from atomc.kernels.triton.kv_cache_write import kv_scale_args, quantize_kv_value
from atomc.kernels.triton.pdl import after_producer
from atomc.kernels.triton.specialize import token_counts

# q and k in two programs a token (the kernel's SPLIT_QK): Qwen3-30B-A3B's RoPE (q/k norms folded
# in) 2.69 against 3.59 us a layer on an H100, batch-1 decode (docs/performance.md section 20)
SPLIT_QK = True


@triton.jit
def _rotate(ptr, row, stride_h, out_ptr, out_row, stride_oh, cos, sin, w_ptr, eps, NUM_HEADS: tl.constexpr,
            HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, NORM: tl.constexpr):  # fmt: skip
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < NUM_HEADS) & (d < HALF)
    p1 = ptr + row + h * stride_h + d
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty  # the input's (the wrapper checks)
    if NORM:
        # as atomc::rms_norm: fp32 statistics over the head, cast back, then times the weight in
        # the tensor's dtype (each rounding where the reference rounds)
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + d, mask=d < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
        x1 = (w1 * (x1 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(dtype)
    y2 = (x2 * cos + x1 * sin).to(dtype)
    o1 = out_ptr + out_row + h * stride_oh + d
    tl.store(o1, y1, mask=mask)
    tl.store(o1 + HALF, y2, mask=mask)
    return y1, y2, h, d, mask  # rounded to the tensor's dtype, as the unfused cache write reads k


@triton.jit(do_not_specialize_on_alignment=token_counts("num_slots"))
def _rope_kernel(
    pos_ptr, q_ptr, k_ptr, v_ptr, cs_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, qw_ptr, kw_ptr, k_scale_ptr, v_scale_ptr,
    q_out_ptr, k_out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, num_slots, q_eps, k_eps,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    PAGE: tl.constexpr, WRITE_KV: tl.constexpr, NORM: tl.constexpr, FP8: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr, SPLIT_QK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    after_producer(PDL)  # pdl.py: everything here but the cos/sin table is written in the step
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    cs = cs_ptr + pos * stride_cs + d
    cos = tl.load(cs, mask=d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cs + HALF, mask=d < HALF, other=0.0).to(tl.float32)
    # SPLIT_QK: program (t, 0) rotates the token's q heads, (t, 1) its k heads and writes its cache
    # slot (at batch 1 the two halves run on two SMs side by side); else one program does both
    if not SPLIT_QK or tl.program_id(1) == 0:
        _rotate(
            q_ptr, t * stride_qt, stride_qh, q_out_ptr, t * stride_qot, stride_qoh, cos, sin, qw_ptr, q_eps,
            NUM_Q_HEADS, HALF, BLOCK_HQ, BLOCK_HALF, NORM,
        )  # fmt: skip
        if SPLIT_QK:
            return
    k1, k2, h, d, mask = _rotate(
        k_ptr, t * stride_kt, stride_kh, k_out_ptr, t * stride_kot, stride_koh, cos, sin, kw_ptr, k_eps,
        NUM_KV_HEADS, HALF, BLOCK_HKV, BLOCK_HALF, NORM,
    )  # fmt: skip
    if WRITE_KV:
        slot = tl.load(slot_ptr + t, mask=t < num_slots, other=-1).to(tl.int64)
        if slot >= 0:
            page = slot // PAGE
            off = slot % PAGE
            kc = k_cache_ptr + page * stride_kcb + off * stride_kcs + h * stride_kch + d
            kd = k_cache_ptr.dtype.element_ty
            tl.store(kc, quantize_kv_value(k1, k_scale_ptr, kd, FP8, ROUND_IN_FP32), mask=mask)
            tl.store(kc + HALF, quantize_kv_value(k2, k_scale_ptr, kd, FP8, ROUND_IN_FP32), mask=mask)
            vp = v_ptr + t * stride_vt + h * stride_vh + d
            vc = v_cache_ptr + page * stride_vcb + off * stride_vcs + h * stride_vch + d
            vd = v_cache_ptr.dtype.element_ty
            v1 = tl.load(vp, mask=mask)
            v2 = tl.load(vp + HALF, mask=mask)
            tl.store(vc, quantize_kv_value(v1, v_scale_ptr, vd, FP8, ROUND_IN_FP32), mask=mask)
            tl.store(vc + HALF, quantize_kv_value(v2, v_scale_ptr, vd, FP8, ROUND_IN_FP32), mask=mask)


def _launch(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, qk_norm, kv_scales, out):
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert head_dim % 2 == 0 and q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    q_out, k_out = out
    for x, o in ((q, q_out), (k, k_out)):
        assert o.shape == x.shape and o.dtype == x.dtype and o.stride(-1) == 1
    if num_tokens == 0:
        return
    write = k_cache is not None
    if write:
        assert v.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
        num_slots = slot_mapping.numel()  # rows beyond it are rotated but not written
        kc_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
        vc_strides = (v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
        v_strides = (v.stride(0), v.stride(1))
        page = k_cache.shape[1]
        k_scale, v_scale, fp8 = kv_scale_args(k_cache, kv_scales, positions)
    else:
        v, k_cache, v_cache, slot_mapping = q, q, q, positions  # unused
        kc_strides = vc_strides = (0, 0, 0)
        v_strides = (0, 0)
        page, num_slots = 1, 0
        k_scale, v_scale, fp8 = positions, positions, False  # unused
    half = head_dim // 2
    q_weight, q_eps, k_weight, k_eps = qk_norm if qk_norm is not None else (q, 0.0, q, 0.0)  # unused
    if qk_norm is not None:
        assert q_weight.shape == k_weight.shape == (head_dim,) and q_weight.is_contiguous() and k_weight.is_contiguous()
    _rope_kernel[(num_tokens, 2 if SPLIT_QK else 1)](
        positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, q_weight, k_weight, k_scale, v_scale,
        q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), *v_strides, cos_sin_cache.stride(0),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        *kc_strides, *vc_strides, num_slots, q_eps, k_eps,
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half), PAGE=page, WRITE_KV=write, NORM=qk_norm is not None,
        FP8=fp8, ROUND_IN_FP32=fp8 and ROUND_IN_FP32, SPLIT_QK=SPLIT_QK, num_warps=4, **pdl.launch(q),
    )  # fmt: skip


def rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    qk_norm: tuple[torch.Tensor, float, torch.Tensor, float] | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] at `positions` [T], in place or into `out` (q_out,
    k_out) of their shapes and dtype (any strides but a unit last one, not overlapping q and k);
    returns the rotated (q, k). `qk_norm` = (q_weight [D], q_eps, k_weight [D], k_eps): RMSNorm
    each head first."""
    out = out or (q, k)
    _launch(positions, q, k, None, cos_sin_cache, None, None, None, qk_norm, None, out)
    return out


def rope_and_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    qk_norm: tuple[torch.Tensor, float, torch.Tensor, float] | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q and k, in place or into `out` (after a per-head RMSNorm with `qk_norm`; both as in
    `rope`), then write rotated k and v to their cache slots (-1 skipped); `kv_scales` (k_scale,
    v_scale) for FP8 pages. Returns the rotated (q, k)."""
    out = out or (q, k)
    _launch(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, qk_norm, kv_scales, out)
    return out
