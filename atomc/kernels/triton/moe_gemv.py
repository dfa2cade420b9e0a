"""The expert GEMMs for one token (batch-1 decode): each chosen expert multiplies exactly one row.

The tensor-core kernels of moe_gemm.py pad that row to 16 and need BLOCK_N >= 16; here each program
multiply-adds a [BLOCK_N, BLOCK_K] weight tile with the row on the CUDA cores into an fp32 register
tile, summed once at the end (as the one-row `gemv` reduce kernel does, which beat cuBLAS at one row
on the H200). BLOCK_N may be 2, so even Qwen3-MoE's 768-row experts give thousands of programs and
the weight stream keeps enough loads in flight. Program (j, n) owns pair j = slot j of the token;
pairs whose expert is on another rank exit at once. Same rounding as moe_gemm.py: act [k, I] in
x's dtype, each expert's output rounded to x's dtype before the fp32 weighted sum.

The down GEMV by default also does the combine (`moe_down_combine_gemv_kernel`, "fuse_combine" in the
down tile): program n owns output rows n*BLOCK_N.. and walks the token's k experts in slot order,
so the [k, H] expert outputs never go to memory and the combine kernel's launch is gone (at one
token every launch is a few microseconds of a ~50 us layer). The unfused pair (down GEMV into y,
then `moe_combine_kernel`) stays as a tuning candidate: the fused kernel has k times fewer programs.

The gate/up and fused down GEMVs also take FP8 experts (WEIGHTS, moe_tiles.py: the tile dequantised
in registers, then the same fp32 multiply-adds); MXFP4 experts have their own GEMVs
(moe_mxfp4_gemv.py), whose tiles keep a scale-group axis.

FP8 experts with per-row scales can take a packed-f16 loop instead (PACKED, the tile knob
`packed_f16`): the dequantising loop costs 7.1 sm_90 instructions a weight byte (widen e4m3 to fp32,
times the row scale, round to bf16 as the reference does, multiply-add) against bf16's 2.0. Packed:
e4m3 -> f16 pairs, f16x2 FMAs with x shifted into f16's range (packed_f16.x_shift, TOP from
`e4m3_weight_x_top`: a column adds ceil(K / BLOCK_K) products of at most 448 * 2^TOP), the row scale once
after the sum. It does not round each dequantised weight to bf16 as the reference does; the
difference is that rounding's, 2^-9 a weight, plus f16's on the few partial sums. Block scales
(128 x 128) take the same loop with each column group's scale folded into x: a program's rows lie
in one row block (block_n divides 128; moe_quant.py keeps the dequantising loop for a gate/up
whose intermediate size is not whole blocks), so x times the group's scale is one vector for the
program (one for its gate rows, one for its up rows); x * scale has f16's 11 significant bits, so
the products round too.
"""

from __future__ import annotations

import triton
import triton.language as tl

from atomc.kernels.triton import pdl
from atomc.kernels.triton.moe_tiles import DENSE, bias_row, round_activate, weight_tile
from atomc.kernels.triton.packed_f16 import shift_for, x_shift
from atomc.kernels.triton.pdl import after_producer


@triton.jit
def _times_group_scales(x, s_row, stride_sk, k0, K, mult, BLOCK_K: tl.constexpr):
    """x[k0 : k0 + BLOCK_K] (fp32) times mult and each value's 128-column weight scale in the row
    block s_row points at (mult folded into the scales: one multiply a value): one scale for a step
    of at most 128 columns (k0 a multiple of BLOCK_K, a power of two), else a [BLOCK_K / 128] load
    times the [BLOCK_K / 128, 128] view."""
    if BLOCK_K <= 128:
        return x * (tl.load(s_row + (k0 // 128) * stride_sk) * mult)
    G: tl.constexpr = BLOCK_K // 128
    grp = k0 // 128 + tl.arange(0, G)
    s = tl.load(s_row + grp * stride_sk, mask=grp * 128 < K, other=0.0) * mult
    return tl.reshape(tl.reshape(x, (G, 128)) * s[:, None], (BLOCK_K,))


@triton.jit
def _x_f16(x_row, s_row, stride_sk, k0, K, mult, BLOCK_SCALED: tl.constexpr, BLOCK_K: tl.constexpr):
    """f16 [1, BLOCK_K]: x[k0 : k0 + BLOCK_K] * mult, with BLOCK_SCALED each value also times its
    group's weight scale in row block s_row (block FP8: every row of the program shares it)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_row + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
    if BLOCK_SCALED:
        x = _times_group_scales(x, s_row, stride_sk, k0, K, mult, BLOCK_K)
    else:
        x = x * mult
    return x.to(tl.float16)[None, :]


@triton.jit
def _block_scaled_x_shift(x_row, s_a, s_b, stride_sk, K, BLOCK_K: tl.constexpr, TOP: tl.constexpr):
    """x_shift's pair for x times its group scales in row block s_a or s_b, whichever is larger
    (gate and up rows; the down GEMV passes one block twice). One pass over x."""
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.abs(tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32))
        xs = tl.maximum(_times_group_scales(x, s_a, stride_sk, k0, K, 1.0, BLOCK_K),
                        _times_group_scales(x, s_b, stride_sk, k0, K, 1.0, BLOCK_K))  # fmt: skip
        amax = tl.maximum(amax, xs)
    return shift_for(tl.max(amax), TOP)


@triton.jit
def _row_dot_f16(
    x_row, w_rows, s_row, stride_sk, n_ok, K, mult, BLOCK_SCALED: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """fp32 [BLOCK_N]: the rows' e4m3 weights (unscaled) dot x * mult (_x_f16: block scales folded
    into x), products and per-column partial sums in f16 (Triton packs them into f16x2 FMAs),
    summed in fp32 at the end."""
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float16)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k < K)[None, :], other=0.0)
        acc += w.to(tl.float16) * _x_f16(x_row, s_row, stride_sk, k0, K, mult, BLOCK_SCALED, BLOCK_K)
    return tl.sum(acc.to(tl.float32), 1)


@triton.jit
def _gate_up_dot_f16(
    x_row, w_gate, w_up, s_gate, s_up, stride_sk, n_ok, K, mult, BLOCK_SCALED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """_row_dot_f16 for the gate and the up rows in one loop: x converted once a step for both
    (per-row scales), or once for each row block (block scales)."""
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float16)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float16)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = n_ok[:, None] & (offs_k < K)[None, :]
        x_g = _x_f16(x_row, s_gate, stride_sk, k0, K, mult, BLOCK_SCALED, BLOCK_K)
        x_u = x_g
        if BLOCK_SCALED:
            x_u = _x_f16(x_row, s_up, stride_sk, k0, K, mult, BLOCK_SCALED, BLOCK_K)
        acc_g += tl.load(w_gate + offs_k[None, :], mask=mask, other=0.0).to(tl.float16) * x_g
        acc_u += tl.load(w_up + offs_k[None, :], mask=mask, other=0.0).to(tl.float16) * x_u
    return tl.sum(acc_g.to(tl.float32), 1), tl.sum(acc_u.to(tl.float32), 1)


@triton.jit
def moe_gate_up_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, act_ptr, local_ids,
    H, INTER, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_be, stride_am,
    alpha, limit,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, WEIGHTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr, PACKED: tl.constexpr = False, X_TOP: tl.constexpr = 0,
):  # fmt: skip
    """act[j, n] = act(x @ w13[e_j, n], x @ w13[e_j, INTER + n]); w13 DENSE or FP8 (moe_tiles.py;
    MXFP4 has its own GEMVs, moe_mxfp4_gemv.py). PACKED: FP8 with per-row scales on f16 pairs."""
    after_producer(PDL)  # pdl.py: the ids and activations come from the step
    j = tl.program_id(0)
    e = tl.load(local_ids + j)
    if e < 0:  # on another rank
        return
    dtype = act_ptr.dtype.element_ty
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    rows = offs_n.to(tl.int64)
    w_gate = w_ptr + e.to(tl.int64) * stride_we + rows[:, None] * stride_wn
    w_up = w_gate + INTER * stride_wn
    s_base = s_ptr + e.to(tl.int64) * stride_se
    if PACKED and WEIGHTS == 2:  # block scales: the program's gate rows share one row block, its up rows another
        n0 = tl.program_id(1) * BLOCK_N
        s_gate = s_base + (n0 // 128) * stride_sn
        s_up = s_base + ((INTER + n0) // 128) * stride_sn
        mult, undo = _block_scaled_x_shift(x_ptr, s_gate, s_up, stride_sk, H, BLOCK_K, X_TOP)
        gate, up = _gate_up_dot_f16(x_ptr, w_gate, w_up, s_gate, s_up, stride_sk, n_ok, H, mult, True, BLOCK_N,
                                    BLOCK_K)  # fmt: skip
        gate *= undo
        up *= undo
    elif PACKED:
        mult, undo = x_shift(x_ptr, H, BLOCK_K, X_TOP)
        gate, up = _gate_up_dot_f16(x_ptr, w_gate, w_up, s_base, s_base, 0, n_ok, H, mult, False, BLOCK_N, BLOCK_K)
        gate *= tl.load(s_base + rows * stride_sn, mask=n_ok, other=0.0) * undo
        up *= tl.load(s_base + (rows + INTER) * stride_sn, mask=n_ok, other=0.0) * undo
    else:
        acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_k, mask=offs_k < H, other=0.0).to(tl.float32)[None, :]
            wg = weight_tile(w_gate, s_base, rows, n_ok, k0, H, stride_sn, stride_sk, dtype, WEIGHTS, BLOCK_N, BLOCK_K)
            wu = weight_tile(w_up, s_base, rows + INTER, n_ok, k0, H, stride_sn, stride_sk, dtype, WEIGHTS, BLOCK_N,
                             BLOCK_K)  # fmt: skip
            acc_g += wg.to(tl.float32) * x
            acc_u += wu.to(tl.float32) * x
        gate = tl.sum(acc_g, 1)
        up = tl.sum(acc_u, 1)
    if HAS_BIAS:
        b = b_ptr + e.to(tl.int64) * stride_be
        gate += bias_row(b, offs_n, n_ok)
        up += bias_row(b + INTER, offs_n, n_ok)
    h = round_activate(gate, up, alpha, limit, dtype, ACT)
    tl.store(act_ptr + j * stride_am + offs_n, h.to(dtype), mask=n_ok)


@triton.jit
def moe_down_gemv_kernel(
    act_ptr, w_ptr, b_ptr, y_ptr, local_ids,
    H, INTER, stride_am, stride_we, stride_wn, stride_be, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    after_producer(PDL)  # pdl.py: the ids and activations come from the step
    j = tl.program_id(0)
    e = tl.load(local_ids + j)
    if e < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    w_rows = w_ptr + e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < INTER
        a = tl.load(act_ptr + j * stride_am + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        acc += tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32) * a
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + e.to(tl.int64) * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + j * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def moe_down_combine_gemv_kernel(
    act_ptr, w_ptr, s_ptr, b_ptr, weights_ptr, local_ids, out_ptr,
    H, INTER, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_be,
    TOPK: tl.constexpr, HAS_BIAS: tl.constexpr, WEIGHTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr, PACKED: tl.constexpr = False, X_TOP: tl.constexpr = 0,
):  # fmt: skip
    """out[n] = sum over slots s (in order) of weight[s] * round(act[s] @ w2[e_s][n] (+ b)); slots whose
    expert is on another rank add nothing. w2 DENSE or FP8; PACKED as the gate/up kernel's."""
    after_producer(PDL)  # pdl.py: the ids and activations come from the step
    dtype = out_ptr.dtype.element_ty
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    rows = offs_n.to(tl.int64)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in tl.static_range(TOPK):
        e = tl.load(local_ids + s)
        if e >= 0:
            w_rows = w_ptr + e.to(tl.int64) * stride_we + rows[:, None] * stride_wn
            s_base = s_ptr + e.to(tl.int64) * stride_se
            if PACKED and WEIGHTS == 2:  # block scales: the program's rows share one row block
                s_row = s_base + (tl.program_id(0) * BLOCK_N // 128) * stride_sn
                a_row = act_ptr + s * stride_am
                mult, undo = _block_scaled_x_shift(a_row, s_row, s_row, stride_sk, INTER, BLOCK_K, X_TOP)
                y = _row_dot_f16(a_row, w_rows, s_row, stride_sk, n_ok, INTER, mult, True, BLOCK_N, BLOCK_K) * undo
            elif PACKED:
                mult, undo = x_shift(act_ptr + s * stride_am, INTER, BLOCK_K, X_TOP)
                y = _row_dot_f16(act_ptr + s * stride_am, w_rows, s_base, 0, n_ok, INTER, mult, False, BLOCK_N, BLOCK_K)
                y *= tl.load(s_base + rows * stride_sn, mask=n_ok, other=0.0) * undo
            else:
                acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
                for k0 in range(0, INTER, BLOCK_K):
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    a = tl.load(act_ptr + s * stride_am + offs_k, mask=offs_k < INTER, other=0.0).to(tl.float32)
                    w = weight_tile(w_rows, s_base, rows, n_ok, k0, INTER, stride_sn, stride_sk, dtype, WEIGHTS,
                                    BLOCK_N, BLOCK_K)  # fmt: skip
                    acc += w.to(tl.float32) * a[None, :]
                y = tl.sum(acc, 1)
            if HAS_BIAS:
                y += bias_row(b_ptr + e.to(tl.int64) * stride_be, offs_n, n_ok)
            y = y.to(dtype).to(tl.float32)  # rounded as the reference's GEMM output
            total += y * tl.load(weights_ptr + s)
    tl.store(out_ptr + offs_n, total.to(dtype), mask=n_ok)


def combines_in_down(config: dict) -> bool:
    """Whether the one-token route's down GEMV writes the weighted sum itself (the down tile's
    "fuse_combine", on by default), so no [k, H] expert outputs and no combine kernel are needed."""
    return config["path"] == "gemv" and config["down"].get("fuse_combine", True)


def launch(
    x, w13, w2, w13_bias, w2_bias, local, weights, act, y, out, activation_code: int, alpha, limit, config: dict
) -> None:
    """Both GEMVs for one token's k pairs (x [1, H], act [k, I], weights fp32 [k]): when
    `combines_in_down(config)` the weighted sum goes to out [1, H] (y unused, may be None), else the
    expert outputs go to y [k, H] for `moe_combine_kernel`."""
    k = local.numel()
    inter, h = w2.shape[2], w2.shape[1]
    gu, dn = config["gate_up"], config["down"]
    moe_gate_up_gemv_kernel[(k, triton.cdiv(inter, gu["block_n"]))](
        x, w13, w13, w13_bias if w13_bias is not None else w13, act, local,
        h, inter, w13.stride(0), w13.stride(1), 0, 0, 0, 0 if w13_bias is None else w13_bias.stride(0), act.stride(0),
        float(alpha), float(limit),
        ACT=activation_code, HAS_BIAS=w13_bias is not None, WEIGHTS=DENSE, BLOCK_N=gu["block_n"], BLOCK_K=gu["block_k"],
        num_warps=gu["num_warps"], num_stages=gu["num_stages"], **pdl.launch(x),
    )  # fmt: skip
    if combines_in_down(config):
        moe_down_combine_gemv_kernel[(triton.cdiv(h, dn["block_n"]),)](
            act, w2, w2, w2_bias if w2_bias is not None else w2, weights, local, out,
            h, inter, act.stride(0), w2.stride(0), w2.stride(1), 0, 0, 0, 0 if w2_bias is None else w2_bias.stride(0),
            TOPK=k, HAS_BIAS=w2_bias is not None, WEIGHTS=DENSE, BLOCK_N=dn["block_n"], BLOCK_K=dn["block_k"],
            num_warps=dn["num_warps"], num_stages=dn["num_stages"], **pdl.launch(x),
        )  # fmt: skip
        return
    moe_down_gemv_kernel[(k, triton.cdiv(h, dn["block_n"]))](
        act, w2, w2_bias if w2_bias is not None else w2, y, local,
        h, inter, act.stride(0), w2.stride(0), w2.stride(1), 0 if w2_bias is None else w2_bias.stride(0), y.stride(0),
        HAS_BIAS=w2_bias is not None, BLOCK_N=dn["block_n"], BLOCK_K=dn["block_k"],
        num_warps=dn["num_warps"], num_stages=dn["num_stages"], **pdl.launch(x),
    )  # fmt: skip
