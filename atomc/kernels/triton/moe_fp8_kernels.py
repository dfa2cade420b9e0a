"""The fused MoE's expert kernels with FP8 (e4m3) weights, dequantised in registers (weight-only).

The bf16 kernels' four (moe_gemv.py, moe_gemm.py) with the same routing (`_rows`), rounding and
combine order; only the weight load differs: an fp8 tile [BLOCK_N, BLOCK_K] times its scale, per
output row (BLOCK_SCALES False: one fp32 per row, loaded once a tile) or per 128x128 block
(BLOCK_SCALES True: each element's block scale, gathered: a tile row holds BLOCK_K / 128 distinct
ones, so the gather is served from cache). The dequantised tile is rounded to the activations' dtype, as the
reference's dequantised weights are, then multiplied: on the tensor-core routes by a bf16/fp16
dot, on the one-token route in fp32 on the CUDA cores. Own kernels, not a switch in the bf16 ones,
so those stay as fast as they were.
"""

from __future__ import annotations

import triton
import triton.language as tl

from atomc.kernels.triton.moe_gemm import _rows
from atomc.kernels.triton.moe_mxfp4_kernels import _swiglu


@triton.jit
def _fp8_tile(
    w_rows, s_base, rows, n_ok, offs_k, k_ok, stride_sn, stride_sk, dtype: tl.constexpr, BLOCK_SCALES: tl.constexpr
):
    """Dequantised weights [BLOCK_N, BLOCK_K] in `dtype`. w_rows: [BLOCK_N, 1] row pointers; s_base:
    the expert's scales; rows: the tile's row numbers in the expert's stacked weight (up rows of w13
    come after its INTER gate rows), which index the scales."""
    mask = n_ok[:, None] & k_ok[None, :]
    w = tl.load(w_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    if BLOCK_SCALES:
        s = tl.load(s_base + (rows // 128)[:, None] * stride_sn + (offs_k // 128)[None, :] * stride_sk,
                    mask=mask, other=0.0)  # fmt: skip
    else:
        s = tl.load(s_base + rows * stride_sn, mask=n_ok, other=0.0)[:, None]
    return (w * s).to(dtype)


@triton.jit
def fp8_gate_up_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, act_ptr, local_ids,
    H, INTER, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_be, stride_am,
    alpha, limit,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_SCALES: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    j = tl.program_id(0)
    e = tl.load(local_ids + j)
    if e < 0:
        return
    dtype = act_ptr.dtype.element_ty
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    wg = w_ptr + e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    wu = wg + INTER * stride_wn
    s_base = s_ptr + e.to(tl.int64) * stride_se
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < H
        x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        g = _fp8_tile(wg, s_base, offs_n, n_ok, offs_k, k_ok, stride_sn, stride_sk, dtype, BLOCK_SCALES)
        u = _fp8_tile(wu, s_base, offs_n + INTER, n_ok, offs_k, k_ok, stride_sn, stride_sk, dtype, BLOCK_SCALES)
        acc_g += g.to(tl.float32) * x
        acc_u += u.to(tl.float32) * x
    gate = tl.sum(acc_g, 1)
    up = tl.sum(acc_u, 1)
    if HAS_BIAS:
        b = b_ptr + e.to(tl.int64) * stride_be
        gate += tl.load(b + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        up += tl.load(b + INTER + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    h = _swiglu(gate, up, alpha, limit, ACT)
    tl.store(act_ptr + j * stride_am + offs_n, h.to(dtype), mask=n_ok)


@triton.jit
def fp8_down_combine_gemv_kernel(
    act_ptr, w_ptr, s_ptr, b_ptr, weights_ptr, local_ids, out_ptr,
    H, INTER, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_be,
    TOPK: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_SCALES: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    dtype = out_ptr.dtype.element_ty
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in tl.static_range(TOPK):
        e = tl.load(local_ids + s)
        if e >= 0:
            w_rows = w_ptr + e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
            s_base = s_ptr + e.to(tl.int64) * stride_se
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for k0 in range(0, INTER, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_ok = offs_k < INTER
                a = tl.load(act_ptr + s * stride_am + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
                w = _fp8_tile(w_rows, s_base, offs_n, n_ok, offs_k, k_ok, stride_sn, stride_sk, dtype, BLOCK_SCALES)
                acc += w.to(tl.float32) * a
            y = tl.sum(acc, 1)
            if HAS_BIAS:
                y += tl.load(b_ptr + e.to(tl.int64) * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            y = y.to(dtype).to(tl.float32)
            total += y * tl.load(weights_ptr + s)
    tl.store(out_ptr + offs_n, total.to(dtype), mask=n_ok)


@triton.jit
def _dot(acc, a, w, IEEE: tl.constexpr):
    if IEEE:
        return acc + tl.dot(a, tl.trans(w), input_precision="ieee")
    return acc + tl.dot(a, tl.trans(w))


@triton.jit
def fp8_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, act_ptr,
    local_ids, sorted_ids, block_expert, num_padded,
    P, H, INTER,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_be, stride_am,
    alpha, limit,
    TOPK: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, ROUTE_SORTED: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_SLOTS: tl.constexpr,
):  # fmt: skip
    e, rows, ok, go = _rows(
        local_ids, sorted_ids, block_expert, num_padded, P, TOPK, ROUTE_SORTED, BLOCK_M, BLOCK_SLOTS
    )
    if go == 0:
        return
    dtype = act_ptr.dtype.element_ty
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    tokens = (rows // TOPK).to(tl.int64)
    wg = w_ptr + e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    wu = wg + INTER * stride_wn
    s_base = s_ptr + e.to(tl.int64) * stride_se
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < H
        a = tl.load(x_ptr + tokens[:, None] * stride_xm + offs_k[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        g = _fp8_tile(wg, s_base, offs_n, n_ok, offs_k, k_ok, stride_sn, stride_sk, a.dtype, BLOCK_SCALES)
        u = _fp8_tile(wu, s_base, offs_n + INTER, n_ok, offs_k, k_ok, stride_sn, stride_sk, a.dtype, BLOCK_SCALES)
        acc_g = _dot(acc_g, a, g, IEEE)
        acc_u = _dot(acc_u, a, u, IEEE)
    if HAS_BIAS:
        b = b_ptr + e.to(tl.int64) * stride_be
        acc_g += tl.load(b + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b + INTER + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    gate = acc_g.to(dtype).to(tl.float32)
    up = acc_u.to(dtype).to(tl.float32)
    h = _swiglu(gate, up, alpha, limit, ACT)
    out = act_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_n[None, :]
    tl.store(out, h.to(dtype), mask=ok[:, None] & n_ok[None, :])


@triton.jit
def fp8_down_kernel(
    act_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
    local_ids, sorted_ids, block_expert, num_padded,
    P, H, INTER,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_be, stride_ym,
    TOPK: tl.constexpr, HAS_BIAS: tl.constexpr, ROUTE_SORTED: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_SLOTS: tl.constexpr,
):  # fmt: skip
    e, rows, ok, go = _rows(
        local_ids, sorted_ids, block_expert, num_padded, P, TOPK, ROUTE_SORTED, BLOCK_M, BLOCK_SLOTS
    )
    if go == 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    a_rows = act_ptr + rows.to(tl.int64)[:, None] * stride_am
    w_rows = w_ptr + e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    s_base = s_ptr + e.to(tl.int64) * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < INTER
        a = tl.load(a_rows + offs_k[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        w = _fp8_tile(w_rows, s_base, offs_n, n_ok, offs_k, k_ok, stride_sn, stride_sk, a.dtype, BLOCK_SCALES)
        acc = _dot(acc, a, w, IEEE)
    if HAS_BIAS:
        acc += tl.load(b_ptr + e.to(tl.int64) * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=ok[:, None] & n_ok[None, :])
