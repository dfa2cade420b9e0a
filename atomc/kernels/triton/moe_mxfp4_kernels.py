"""The fused MoE's expert kernels with MXFP4 weights, dequantised in registers (Hopper has no FP4 MMA).

The same four kernels as the bf16 ones (moe_gemv.py: one token; moe_gemm.py: few or sorted pairs),
and the same routing (`_rows`), rounding and combine order, so they match `atomc::moe_quant`'s
reference as the bf16 kernels match atomc::moe's. Only the weight load differs, and it is its own
kernel (not a switch in the bf16 ones) so the bf16 kernels stay exactly as fast as they were.

A weight tile is read as bytes [BLOCK_N, BLOCK_K / 2]: byte b of a row holds input values 2b (low
nibble) and 2b + 1 (high nibble); its scale is the row's e8m0 byte b // 16. The two nibbles are
decoded to two value tiles (e2m1 by arithmetic on the code's bits, times 2^(scale - 127)) and
multiplied with the even and the odd input values apart: two half-depth products instead of one,
the same multiply-adds, and no interleaving of registers. On the tensor-core route the decoded
values are cast to the activation dtype before the dot, exact (e2m1 values scaled by a power of two
fit fp16/bf16), as the reference's dequantised weights are.
"""

from __future__ import annotations

import triton
import triton.language as tl

from atomc.kernels.triton.moe_gemm import _rows

MXFP4_BYTES_PER_SCALE = 16  # 32 values, two a byte


@triton.jit
def _e2m1(code):
    """e2m1 code (int32, 0..15) -> its fp32 value: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0."""
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    normal = (1 << tl.maximum(e - 1, 0)).to(tl.float32) * (1.0 + 0.5 * m)
    v = tl.where(e == 0, 0.5 * m, normal)
    return tl.where((code & 8) != 0, -v, v)


@triton.jit
def _mxfp4_tile(w_rows, s_rows, offs_b, mask):
    """(even-index values, odd-index values) fp32 [BLOCK_N, BLOCK_KB] of the bytes offs_b of each row
    (`w_rows` / `s_rows`: [BLOCK_N, 1] pointers to each row's bytes / scales)."""
    byte = tl.load(w_rows + offs_b[None, :], mask=mask, other=0).to(tl.int32)
    exponent = tl.load(s_rows + (offs_b // 16)[None, :], mask=mask, other=127).to(tl.float32)
    scale = tl.exp2(exponent - 127.0)
    return _e2m1(byte & 15) * scale, _e2m1(byte >> 4) * scale


@triton.jit
def _swiglu(gate, up, alpha, limit, ACT: tl.constexpr):
    if ACT == 0:  # silu(gate) * up
        return gate / (1.0 + tl.exp(-gate)) * up
    gate = tl.minimum(gate, limit)  # GPT-OSS: gate clamped above, up both ways
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return gate / (1.0 + tl.exp(-alpha * gate)) * (up + 1.0)


@triton.jit
def mxfp4_gate_up_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, act_ptr, local_ids,
    H, INTER, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_am,
    alpha, limit,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr,
):  # fmt: skip
    """One token: act[j, n] = act(x @ w13[e_j, n], x @ w13[e_j, INTER + n]); BLOCK_KB bytes a step."""
    j = tl.program_id(0)
    e = tl.load(local_ids + j)
    if e < 0:  # on another rank
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    rows = offs_n.to(tl.int64)[:, None]
    wg = w_ptr + e.to(tl.int64) * stride_we + rows * stride_wn
    wu = wg + INTER * stride_wn
    sg = s_ptr + e.to(tl.int64) * stride_se + rows * stride_sn
    su = sg + INTER * stride_sn
    acc_g = tl.zeros((BLOCK_N, BLOCK_KB), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_KB), dtype=tl.float32)
    HB = H // 2
    for b0 in range(0, HB, BLOCK_KB):
        offs_b = b0 + tl.arange(0, BLOCK_KB)
        b_ok = offs_b < HB
        x_even = tl.load(x_ptr + 2 * offs_b, mask=b_ok, other=0.0).to(tl.float32)[None, :]
        x_odd = tl.load(x_ptr + 2 * offs_b + 1, mask=b_ok, other=0.0).to(tl.float32)[None, :]
        wm = n_ok[:, None] & b_ok[None, :]
        lo, hi = _mxfp4_tile(wg, sg, offs_b, wm)
        acc_g += lo * x_even + hi * x_odd
        lo, hi = _mxfp4_tile(wu, su, offs_b, wm)
        acc_u += lo * x_even + hi * x_odd
    gate = tl.sum(acc_g, 1)
    up = tl.sum(acc_u, 1)
    if HAS_BIAS:
        b = b_ptr + e.to(tl.int64) * stride_be
        gate += tl.load(b + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        up += tl.load(b + INTER + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    gate = gate.to(act_ptr.dtype.element_ty).to(tl.float32)  # rounded as the reference's GEMM output
    up = up.to(act_ptr.dtype.element_ty).to(tl.float32)
    h = _swiglu(gate, up, alpha, limit, ACT)
    tl.store(act_ptr + j * stride_am + offs_n, h.to(act_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def mxfp4_down_combine_gemv_kernel(
    act_ptr, w_ptr, s_ptr, b_ptr, weights_ptr, local_ids, out_ptr,
    H, INTER, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_be,
    TOPK: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr,
):  # fmt: skip
    """One token: out[n] = sum over slots s (in order) of weight[s] * round(act[s] @ w2[e_s, n] (+ b))."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    rows = offs_n.to(tl.int64)[:, None]
    IB = INTER // 2
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in tl.static_range(TOPK):
        e = tl.load(local_ids + s)
        if e >= 0:
            w_rows = w_ptr + e.to(tl.int64) * stride_we + rows * stride_wn
            s_rows = s_ptr + e.to(tl.int64) * stride_se + rows * stride_sn
            acc = tl.zeros((BLOCK_N, BLOCK_KB), dtype=tl.float32)
            for b0 in range(0, IB, BLOCK_KB):
                offs_b = b0 + tl.arange(0, BLOCK_KB)
                b_ok = offs_b < IB
                a_even = tl.load(act_ptr + s * stride_am + 2 * offs_b, mask=b_ok, other=0.0).to(tl.float32)
                a_odd = tl.load(act_ptr + s * stride_am + 2 * offs_b + 1, mask=b_ok, other=0.0).to(tl.float32)
                lo, hi = _mxfp4_tile(w_rows, s_rows, offs_b, n_ok[:, None] & b_ok[None, :])
                acc += lo * a_even[None, :] + hi * a_odd[None, :]
            y = tl.sum(acc, 1)
            if HAS_BIAS:
                y += tl.load(b_ptr + e.to(tl.int64) * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            y = y.to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded as the reference's GEMM output
            total += y * tl.load(weights_ptr + s)
    tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _dot2(acc, a_even, a_odd, lo, hi, IEEE: tl.constexpr):
    """acc + a_even @ lo.T + a_odd @ hi.T, the decoded weights cast to the activations' dtype."""
    lo = lo.to(a_even.dtype)
    hi = hi.to(a_even.dtype)
    if IEEE:  # fp32 inputs: exact fp32 products, not TF32
        acc += tl.dot(a_even, tl.trans(lo), input_precision="ieee")
        acc += tl.dot(a_odd, tl.trans(hi), input_precision="ieee")
    else:
        acc += tl.dot(a_even, tl.trans(lo))
        acc += tl.dot(a_odd, tl.trans(hi))
    return acc


@triton.jit
def mxfp4_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, act_ptr,
    local_ids, sorted_ids, block_expert, num_padded,
    P, H, INTER,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_am,
    alpha, limit,
    TOPK: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, ROUTE_SORTED: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr, BLOCK_SLOTS: tl.constexpr,
):  # fmt: skip
    """moe_gate_up_kernel with MXFP4 w13 (BLOCK_KB bytes = 2 * BLOCK_KB input values a step)."""
    e, rows, ok, go = _rows(
        local_ids, sorted_ids, block_expert, num_padded, P, TOPK, ROUTE_SORTED, BLOCK_M, BLOCK_SLOTS
    )
    if go == 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    tokens = (rows // TOPK).to(tl.int64)
    wrows = offs_n.to(tl.int64)[:, None]
    wg = w_ptr + e.to(tl.int64) * stride_we + wrows * stride_wn
    wu = wg + INTER * stride_wn
    sg = s_ptr + e.to(tl.int64) * stride_se + wrows * stride_sn
    su = sg + INTER * stride_sn
    x_rows = x_ptr + tokens[:, None] * stride_xm
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    HB = H // 2
    for b0 in range(0, HB, BLOCK_KB):
        offs_b = b0 + tl.arange(0, BLOCK_KB)
        b_ok = offs_b < HB
        am = ok[:, None] & b_ok[None, :]
        a_even = tl.load(x_rows + 2 * offs_b[None, :], mask=am, other=0.0)
        a_odd = tl.load(x_rows + 2 * offs_b[None, :] + 1, mask=am, other=0.0)
        wm = n_ok[:, None] & b_ok[None, :]
        lo, hi = _mxfp4_tile(wg, sg, offs_b, wm)
        acc_g = _dot2(acc_g, a_even, a_odd, lo, hi, IEEE)
        lo, hi = _mxfp4_tile(wu, su, offs_b, wm)
        acc_u = _dot2(acc_u, a_even, a_odd, lo, hi, IEEE)
    if HAS_BIAS:
        b = b_ptr + e.to(tl.int64) * stride_be
        acc_g += tl.load(b + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b + INTER + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    gate = acc_g.to(act_ptr.dtype.element_ty).to(tl.float32)
    up = acc_u.to(act_ptr.dtype.element_ty).to(tl.float32)
    h = _swiglu(gate, up, alpha, limit, ACT)
    out = act_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_n[None, :]
    tl.store(out, h.to(act_ptr.dtype.element_ty), mask=ok[:, None] & n_ok[None, :])


@triton.jit
def mxfp4_down_kernel(
    act_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
    local_ids, sorted_ids, block_expert, num_padded,
    P, H, INTER,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_ym,
    TOPK: tl.constexpr, HAS_BIAS: tl.constexpr, ROUTE_SORTED: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr, BLOCK_SLOTS: tl.constexpr,
):  # fmt: skip
    """moe_down_kernel with MXFP4 w2."""
    e, rows, ok, go = _rows(
        local_ids, sorted_ids, block_expert, num_padded, P, TOPK, ROUTE_SORTED, BLOCK_M, BLOCK_SLOTS
    )
    if go == 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    a_rows = act_ptr + rows.to(tl.int64)[:, None] * stride_am
    wrows = offs_n.to(tl.int64)[:, None]
    w_rows = w_ptr + e.to(tl.int64) * stride_we + wrows * stride_wn
    s_rows = s_ptr + e.to(tl.int64) * stride_se + wrows * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    IB = INTER // 2
    for b0 in range(0, IB, BLOCK_KB):
        offs_b = b0 + tl.arange(0, BLOCK_KB)
        b_ok = offs_b < IB
        am = ok[:, None] & b_ok[None, :]
        a_even = tl.load(a_rows + 2 * offs_b[None, :], mask=am, other=0.0)
        a_odd = tl.load(a_rows + 2 * offs_b[None, :] + 1, mask=am, other=0.0)
        lo, hi = _mxfp4_tile(w_rows, s_rows, offs_b, n_ok[:, None] & b_ok[None, :])
        acc = _dot2(acc, a_even, a_odd, lo, hi, IEEE)
    if HAS_BIAS:
        acc += tl.load(b_ptr + e.to(tl.int64) * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=ok[:, None] & n_ok[None, :])
