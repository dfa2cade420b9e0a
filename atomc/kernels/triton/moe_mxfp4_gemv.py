"""The few-token (decode) expert GEMVs with MXFP4 weights, dequantised in registers.

The fused MoE's gemv route (moe_gemv.py) for MXFP4 experts: program (j, n) owns (token, expert)
pair j (token j // TOPK) and BLOCK_N weight rows (gate/up), or (n, t) BLOCK_N output rows of token
t over its k experts in slot order (down, with the weighted sum: no [k, H] expert outputs, no
combine kernel); same rounding as the bf16 GEMVs. Past one token each pair reads its expert's
rows itself: pairs of one expert run side by side, so the repeats mostly come from L2, and the
decode, the kernel's real cost, is paid once a pair either way (moe_config.GEMV_MAX_TOKENS). The
tensor-core routes need no kernel of their own: moe_gemm.py's take the format as a constexpr
(moe_tiles.weight_tile).

At one token the decode is the work (a byte of weights feeds two multiply-adds), so a weight step
is a [BLOCK_N, BLOCK_K / 32, 16]-byte tile: 16 contiguous bytes (one scale group) innermost, a
vectorised load; its scales one [BLOCK_N, BLOCK_K / 32] load, each used by 32 values; the nibbles
decoded by bit arithmetic (moe_tiles.e2m1_pair: a few integer ops and two multiplies a value, no
table, no exp2, no int-to-float conversion). The low nibbles multiply the even inputs and the high
nibbles the odd ones: x is loaded once a step (for the gate and the up tile) as contiguous pairs
[BLOCK_K / 32, 16, 2] and split; the weights are never re-laid out (x is, through shared memory:
in sm_90 SASS one round trip a step; reading x as one int32 a pair instead cost four), and the
fp32 products sum into a [BLOCK_N, BLOCK_K / 32, 16] register tile reduced once at the end. In
that SASS a 16-byte weight step of a thread is ~8 integer ops a byte (byte extract, two shifts
and a mask a nibble) and ~8 fp32 ops (two multiplies a value and its multiply-add): about 4x fewer
instructions a byte than the first version, whose scale gather, exp2 and int-to-float
conversions per value made the kernel slower than bf16.
"""

from __future__ import annotations

import triton
import triton.language as tl

from atomc.kernels.triton.moe_tiles import bias_row, e2m1_pair, mxfp4_bytes, round_activate
from atomc.kernels.triton.mxfp4_packed import E2M1_UNDO, X_TOP, group_sums, mxfp4_words, x_pairs
from atomc.kernels.triton.packed_f16 import x_shift
from atomc.kernels.triton.pdl import after_producer


@triton.jit
def _input_pairs(x_row, k0, K, BLOCK_K: tl.constexpr):
    """(even, odd) fp32 [BLOCK_K / 32, 16] inputs k0 .. k0 + BLOCK_K of a row: the two inputs of
    byte (g, j) of a weight tile, loaded as contiguous pairs and split."""
    G: tl.constexpr = BLOCK_K // 32
    grp = k0 // 32 + tl.arange(0, G)
    offs = grp[:, None, None] * 32 + tl.arange(0, 16)[None, :, None] * 2 + tl.arange(0, 2)[None, None, :]
    x = tl.load(x_row + offs, mask=(grp < K // 32)[:, None, None], other=0.0).to(tl.float32)
    return tl.split(x)


@triton.jit
def _mxfp4_gemv_step(acc, w_rows, s_rows, n_ok, x_even, x_odd, k0, K, BLOCK_K: tl.constexpr):
    """acc [BLOCK_N, G, 16] + the products of rows w_rows' values k0 .. k0 + BLOCK_K with the inputs."""
    byte, scale = mxfp4_bytes(w_rows, s_rows, n_ok, k0, K, BLOCK_K)
    lo, hi = e2m1_pair(byte, scale)
    return acc + lo * x_even[None, :, :] + hi * x_odd[None, :, :]


@triton.jit
def mxfp4_gate_up_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, act_ptr, local_ids,
    H, INTER, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_am,
    alpha, limit, stride_xm,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr, PACKED: tl.constexpr = False, ASM: tl.constexpr = False, TOPK: tl.constexpr = 1,
):  # fmt: skip
    """act[j, n] = act(x_t @ w13[e_j, n], x_t @ w13[e_j, INTER + n]) for pair j of token
    t = j // TOPK; BLOCK_K values a step. PACKED: mxfp4_packed.py's f16-pair step (ASM: its PTX;
    H a multiple of 8)."""
    after_producer(PDL)  # pdl.py: the ids and activations come from the step
    j = tl.program_id(0)
    e = tl.load(local_ids + j)
    if e < 0:  # on another rank
        return
    x_ptr += (j // TOPK).to(tl.int64) * stride_xm
    dtype = act_ptr.dtype.element_ty
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    rows = offs_n.to(tl.int64)[:, None]
    wg = w_ptr + e.to(tl.int64) * stride_we + rows * stride_wn
    wu = wg + INTER * stride_wn
    sg = s_ptr + e.to(tl.int64) * stride_se + rows * stride_sn
    su = sg + INTER * stride_sn
    if PACKED:
        mult, undo = x_shift(x_ptr, H, BLOCK_K, X_TOP)
        wg32, wu32 = wg.to(tl.pointer_type(tl.int32)), wu.to(tl.pointer_type(tl.int32))
        sums_g = tl.zeros((BLOCK_N, BLOCK_K // 32), dtype=tl.float32)
        sums_u = tl.zeros((BLOCK_N, BLOCK_K // 32), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            x0, x1, x2, x3 = x_pairs(x_ptr, k0, H, mult, BLOCK_K)  # shared by the gate and up tiles
            words, scale = mxfp4_words(wg32, sg, n_ok, k0, H, BLOCK_K)
            sums_g += group_sums(words, x0, x1, x2, x3, ASM) * scale
            words, scale = mxfp4_words(wu32, su, n_ok, k0, H, BLOCK_K)
            sums_u += group_sums(words, x0, x1, x2, x3, ASM) * scale
        gate = tl.sum(sums_g, 1) * (undo * E2M1_UNDO)
        up = tl.sum(sums_u, 1) * (undo * E2M1_UNDO)
    else:
        acc_g = tl.zeros((BLOCK_N, BLOCK_K // 32, 16), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K // 32, 16), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            x_even, x_odd = _input_pairs(x_ptr, k0, H, BLOCK_K)  # shared by the gate and up tiles
            acc_g = _mxfp4_gemv_step(acc_g, wg, sg, n_ok, x_even, x_odd, k0, H, BLOCK_K)
            acc_u = _mxfp4_gemv_step(acc_u, wu, su, n_ok, x_even, x_odd, k0, H, BLOCK_K)
        gate = tl.sum(tl.sum(acc_g, 2), 1)
        up = tl.sum(tl.sum(acc_u, 2), 1)
    if HAS_BIAS:
        b = b_ptr + e.to(tl.int64) * stride_be
        gate += bias_row(b, offs_n, n_ok)
        up += bias_row(b + INTER, offs_n, n_ok)
    h = round_activate(gate, up, alpha, limit, dtype, ACT)
    tl.store(act_ptr + j * stride_am + offs_n, h.to(dtype), mask=n_ok)


@triton.jit
def mxfp4_down_combine_gemv_kernel(
    act_ptr, w_ptr, s_ptr, b_ptr, weights_ptr, local_ids, out_ptr,
    H, INTER, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_om,
    TOPK: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr, PACKED: tl.constexpr = False, ASM: tl.constexpr = False,
):  # fmt: skip
    """Token t = program_id(1): out[t, n] = sum over its slots s (in order) of
    weight[t, s] * round(act[t * TOPK + s] @ w2[e_s, n] (+ b)). PACKED / ASM: as the gate/up
    kernel's (INTER a multiple of 8)."""
    after_producer(PDL)  # pdl.py: the ids and activations come from the step
    token = tl.program_id(1).to(tl.int64)
    local_ids += token * TOPK
    weights_ptr += token * TOPK
    act_ptr += token * TOPK * stride_am
    out_ptr += token * stride_om
    dtype = out_ptr.dtype.element_ty
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    rows = offs_n.to(tl.int64)[:, None]
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in tl.static_range(TOPK):
        e = tl.load(local_ids + s)
        if e >= 0:
            w_rows = w_ptr + e.to(tl.int64) * stride_we + rows * stride_wn
            s_rows = s_ptr + e.to(tl.int64) * stride_se + rows * stride_sn
            a_row = act_ptr + s * stride_am
            if PACKED:
                mult, undo = x_shift(a_row, INTER, BLOCK_K, X_TOP)
                w32 = w_rows.to(tl.pointer_type(tl.int32))
                sums = tl.zeros((BLOCK_N, BLOCK_K // 32), dtype=tl.float32)
                for k0 in range(0, INTER, BLOCK_K):
                    a0, a1, a2, a3 = x_pairs(a_row, k0, INTER, mult, BLOCK_K)
                    words, scale = mxfp4_words(w32, s_rows, n_ok, k0, INTER, BLOCK_K)
                    sums += group_sums(words, a0, a1, a2, a3, ASM) * scale
                y = tl.sum(sums, 1) * (undo * E2M1_UNDO)
            else:
                acc = tl.zeros((BLOCK_N, BLOCK_K // 32, 16), dtype=tl.float32)
                for k0 in range(0, INTER, BLOCK_K):
                    a_even, a_odd = _input_pairs(a_row, k0, INTER, BLOCK_K)
                    acc = _mxfp4_gemv_step(acc, w_rows, s_rows, n_ok, a_even, a_odd, k0, INTER, BLOCK_K)
                y = tl.sum(tl.sum(acc, 2), 1)
            if HAS_BIAS:
                y += bias_row(b_ptr + e.to(tl.int64) * stride_be, offs_n, n_ok)
            y = y.to(dtype).to(tl.float32)  # rounded as the reference's GEMM output
            total += y * tl.load(weights_ptr + s)
    tl.store(out_ptr + offs_n, total.to(dtype), mask=n_ok)
