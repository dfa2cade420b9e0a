"""The two expert GEMMs of the fused MoE (gate/up with the activation, then down), one kernel each.

Both paths of `fused_moe` run these kernels; they differ only in how a program finds the rows
(chosen (token, expert) pairs, numbered p = token * top_k + slot) that it multiplies by one expert:
- ROUTE_SORTED=False, few pairs: program j owns pair j's expert if j is that expert's first pair
  (every other program with the same expert exits at once); it scans the [tokens, k] ids and takes
  each token's pair with that expert, one tile row per token (BLOCK_M >= tokens: an expert has at
  most one pair per token). No sort, no host sync, each chosen expert's weight rows read once
  (x's rows padded to BLOCK_M for the tensor-core dot; the padding costs no memory traffic).
- ROUTE_SORTED=True, many pairs: pairs sorted by expert and padded to BLOCK_M
  (`moe_align.align_by_expert`); program b takes block b of `sorted_ids` and the block's expert;
  blocks past the padded total exit at once, so the grid is sized for the worst case.

Both write per-pair rows ([P, I] activations, then [P, H] expert outputs in x's dtype, as the
reference rounds them); the weighted sum over k is `moe_combine`. Each output row is written by
exactly one program: no atomics, the same result every run. For one token on the few-pair route
the down kernel can do that sum itself (COMBINE_LAST): the last program of an output tile to
arrive (arrivals.py) sums the tile's k expert rows in slot order, as `moe_combine_kernel` does.

The expert weights may be quantised (WEIGHTS, a moe_tiles.py format code: FP8 per row or per
128x128 block, MXFP4): each weight tile is then dequantised in registers to the activations'
dtype before the tensor-core dot (`weight_tile`). The format is a constexpr, so the bf16 kernels
compile to the same plain loads they had; the quantised formats share the routing, loop and
epilogue instead of copying them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from atomc.kernels.triton.arrivals import arrive, reset
from atomc.kernels.triton.moe_tiles import (
    bias_row,
    block_scales_at,
    e4m3_scale,
    quantize_e4m3,
    round_activate,
    weight_tile,
)
from atomc.kernels.triton.pdl import after_producer
from atomc.kernels.triton.specialize import token_counts


@triton.jit
def _rows(
    local_ids, sorted_ids, block_expert, num_padded, P,
    TOPK: tl.constexpr, ROUTE_SORTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SLOTS: tl.constexpr,
):  # fmt: skip
    """(expert, pair rows [BLOCK_M], row mask, go) for this program; go (int32) is 0 for a program
    with nothing to do."""
    j = tl.program_id(0)
    if ROUTE_SORTED:
        # the grid has one program per block of sorted_ids / block_expert: no bounds to mask
        go = j * BLOCK_M < tl.load(num_padded)
        e = tl.load(block_expert + j)
        rows = tl.load(sorted_ids + j * BLOCK_M + tl.arange(0, BLOCK_M))
        ok = rows < P
    else:
        # a token picks an expert at most once, so an expert has at most one pair per token: row r
        # of the tile is token r (BLOCK_M >= tokens), holding its pair with this expert if it has one
        e = tl.load(local_ids + j)
        pairs = tl.arange(0, BLOCK_M)[:, None] * TOPK + tl.arange(0, BLOCK_SLOTS)[None, :]
        valid = (pairs < P) & (tl.arange(0, BLOCK_SLOTS)[None, :] < TOPK)
        match = (tl.load(local_ids + pairs, mask=valid, other=-1) == e) & valid
        go = tl.min(tl.min(tl.where(match, pairs, P), 1), 0) == j  # j is the expert's first pair
        rows = tl.sum(tl.where(match, pairs, 0), 1)
        ok = tl.sum(match.to(tl.int32), 1) > 0
    go = (go & (e >= 0)).to(tl.int32)  # -1: the expert lives on another rank
    return e, rows, ok, go


@triton.jit
def _dot(acc, a, w, IEEE: tl.constexpr):
    """acc + a @ w.T; fp32 inputs (IEEE) as exact fp32 products, not TF32."""
    if IEEE:
        return acc + tl.dot(a, tl.trans(w), input_precision="ieee")
    return acc + tl.dot(a, tl.trans(w))


@triton.jit
def _a8_token_scale(a_rows, ok, K, BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Each row's dynamic per-token FP8 scale over its K values (one pass, rows from L2); ones for
    block weights, whose scales come a step at a time (`_a8_step`)."""
    scale = tl.full((BLOCK_M,), 1.0, tl.float32)
    if not BLOCKS:
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_rows + offs_k[None, :], mask=ok[:, None] & (offs_k < K)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(a.to(tl.float32)), 1))
        scale = e4m3_scale(amax)
    return scale


@triton.jit
def _a8_step(a_rows, ok, k0, K, row_scale, BLOCKS: tl.constexpr, BLOCK_K: tl.constexpr):
    """(e4m3 [BLOCK_M, BLOCK_K] activations of this step, their fp32 scale a row): the per-token
    scale given, or (BLOCKS) the step's own, the step being one 128-value group (BLOCK_K = 128)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    a = tl.load(a_rows + offs_k[None, :], mask=ok[:, None] & (offs_k < K)[None, :], other=0.0).to(tl.float32)
    scale = row_scale
    if BLOCKS:
        scale = e4m3_scale(tl.max(tl.abs(a), 1))
    return quantize_e4m3(a, scale), scale


@triton.jit
def _a8_dot(aq, w_rows, n_ok, k0, K, BLOCK_K: tl.constexpr):
    """e4m3 activations times the raw e4m3 weight rows' tile (transposed), fp32: products exact."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k < K)[None, :], other=0.0)
    return tl.dot(aq, tl.trans(w))


@triton.jit
def _a8_step_scales(d, a_scale, s_base, rows, n_ok, k0, stride_sn, stride_sk, BLOCKS: tl.constexpr):
    """A step's dot times its activation and 128x128-block weight scales for block weights; per-row
    scales wait for `_a8_row_scales`, after the last step."""
    if BLOCKS:
        d = d * a_scale[:, None] * block_scales_at(s_base, rows, n_ok, k0, stride_sn, stride_sk)[None, :]
    return d


@triton.jit
def _a8_row_scales(acc, a_scale, s_base, rows, n_ok, stride_sn, BLOCKS: tl.constexpr):
    """The per-token activation and per-row weight scales on the finished sums (block weights had
    theirs a step at a time)."""
    if not BLOCKS:
        acc *= a_scale[:, None] * tl.load(s_base + rows * stride_sn, mask=n_ok, other=0.0)[None, :]
    return acc


@triton.jit(do_not_specialize_on_alignment=token_counts("P"))
def moe_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, act_ptr,
    local_ids, sorted_ids, block_expert, num_padded,
    P, H, INTER,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_be, stride_am,
    alpha, limit,
    TOPK: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr, ROUTE_SORTED: tl.constexpr, IEEE: tl.constexpr,
    WEIGHTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_SLOTS: tl.constexpr,
    PDL: tl.constexpr, A8: tl.constexpr = False,
):  # fmt: skip
    """act[p, n] = act(x[p // TOPK] @ w13[e, n] (gate), x @ w13[e, INTER + n] (up)) for this block's
    pairs; w13 in the WEIGHTS format (moe_tiles.py; s_ptr its scales, unused for DENSE). A8 (FP8
    weights): x quantised to e4m3 with dynamic scales (per token for per-row weights, per 128-value
    group for blocks) and the raw e4m3 weights into an e4m3 dot, scales applied to the fp32 sums."""
    after_producer(PDL)  # pdl.py: the ids and activations come from the step
    e, rows, ok, go = _rows(
        local_ids, sorted_ids, block_expert, num_padded, P, TOPK, ROUTE_SORTED, BLOCK_M, BLOCK_SLOTS
    )
    if go == 0:
        return
    dtype = act_ptr.dtype.element_ty
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    tokens = (rows // TOPK).to(tl.int64)
    rows_g = offs_n.to(tl.int64)
    w_gate = w_ptr + e.to(tl.int64) * stride_we + rows_g[:, None] * stride_wn
    w_up = w_gate + INTER * stride_wn
    s_base = s_ptr + e.to(tl.int64) * stride_se
    x_rows = x_ptr + tokens[:, None] * stride_xm
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    BLOCKS: tl.constexpr = WEIGHTS == 2
    if A8:
        x_scale = _a8_token_scale(x_rows, ok, H, BLOCKS, BLOCK_M, BLOCK_K)
        for k0 in range(0, H, BLOCK_K):
            aq, s_x = _a8_step(x_rows, ok, k0, H, x_scale, BLOCKS, BLOCK_K)
            dg = _a8_dot(aq, w_gate, n_ok, k0, H, BLOCK_K)
            du = _a8_dot(aq, w_up, n_ok, k0, H, BLOCK_K)
            acc_g += _a8_step_scales(dg, s_x, s_base, rows_g, n_ok, k0, stride_sn, stride_sk, BLOCKS)
            acc_u += _a8_step_scales(du, s_x, s_base, rows_g + INTER, n_ok, k0, stride_sn, stride_sk, BLOCKS)
        acc_g = _a8_row_scales(acc_g, x_scale, s_base, rows_g, n_ok, stride_sn, BLOCKS)
        acc_u = _a8_row_scales(acc_u, x_scale, s_base, rows_g + INTER, n_ok, stride_sn, BLOCKS)
    else:
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_rows + offs_k[None, :], mask=ok[:, None] & (offs_k < H)[None, :], other=0.0)
            wg = weight_tile(w_gate, s_base, rows_g, n_ok, k0, H, stride_sn, stride_sk, a.dtype, WEIGHTS, BLOCK_N,
                             BLOCK_K)  # fmt: skip
            wu = weight_tile(w_up, s_base, rows_g + INTER, n_ok, k0, H, stride_sn, stride_sk, a.dtype, WEIGHTS,
                             BLOCK_N, BLOCK_K)  # fmt: skip
            acc_g = _dot(acc_g, a, wg, IEEE)
            acc_u = _dot(acc_u, a, wu, IEEE)
    if HAS_BIAS:
        b = b_ptr + e.to(tl.int64) * stride_be
        acc_g += bias_row(b, offs_n, n_ok)[None, :]
        acc_u += bias_row(b + INTER, offs_n, n_ok)[None, :]
    h = round_activate(acc_g, acc_u, alpha, limit, dtype, ACT)
    out = act_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_n[None, :]
    tl.store(out, h.to(dtype), mask=ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize_on_alignment=token_counts("P"))
def moe_down_kernel(
    act_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
    local_ids, sorted_ids, block_expert, num_padded,
    P, H, INTER,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_be, stride_ym,
    TOPK: tl.constexpr, HAS_BIAS: tl.constexpr, ROUTE_SORTED: tl.constexpr, IEEE: tl.constexpr,
    WEIGHTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_SLOTS: tl.constexpr,
    PDL: tl.constexpr, A8: tl.constexpr = False,
    weights_ptr=None, out_ptr=None, counter_ptr=None, COMBINE_LAST: tl.constexpr = False,
):  # fmt: skip
    """y[p, n] = act[p] @ w2[e, n] (+ b2[e, n]) for this block's pairs, in y's dtype; w2 in the WEIGHTS
    format; A8 as the gate/up kernel's (act quantised). COMBINE_LAST (one token, the few-pair
    route: program j is slot j): also out[0, tile] = the routing-weighted sum of the tile's k rows,
    by the tile's last program to arrive (a counter a tile)."""
    after_producer(PDL)  # pdl.py: the ids and activations come from the step
    e, rows, ok, go = _rows(
        local_ids, sorted_ids, block_expert, num_padded, P, TOPK, ROUTE_SORTED, BLOCK_M, BLOCK_SLOTS
    )
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    if COMBINE_LAST:
        # the programs that arrive: one a distinct expert of this rank (_rows' first-pair rule)
        slots = tl.arange(0, BLOCK_SLOTS)
        ids = tl.load(local_ids + slots, mask=slots < TOPK, other=-1)
        seen = tl.sum(((ids[:, None] == ids[None, :]) & (slots[None, :] < slots[:, None])).to(tl.int32), 1)
        arriving = tl.sum(((ids >= 0) & (seen == 0)).to(tl.int32), 0)
        if arriving == 0:  # none of the token's experts is on this rank: its share is zero
            if tl.program_id(0) == 0:
                tl.store(out_ptr + offs_n, tl.zeros((BLOCK_N,), tl.float32).to(out_ptr.dtype.element_ty), mask=n_ok)
    if go == 0:
        return
    a_rows = act_ptr + rows.to(tl.int64)[:, None] * stride_am
    w_n = offs_n.to(tl.int64)
    w_rows = w_ptr + e.to(tl.int64) * stride_we + w_n[:, None] * stride_wn
    s_base = s_ptr + e.to(tl.int64) * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    BLOCKS: tl.constexpr = WEIGHTS == 2
    if A8:
        a_scale = _a8_token_scale(a_rows, ok, INTER, BLOCKS, BLOCK_M, BLOCK_K)
        for k0 in range(0, INTER, BLOCK_K):
            aq, s_a = _a8_step(a_rows, ok, k0, INTER, a_scale, BLOCKS, BLOCK_K)
            d = _a8_dot(aq, w_rows, n_ok, k0, INTER, BLOCK_K)
            acc += _a8_step_scales(d, s_a, s_base, w_n, n_ok, k0, stride_sn, stride_sk, BLOCKS)
        acc = _a8_row_scales(acc, a_scale, s_base, w_n, n_ok, stride_sn, BLOCKS)
    else:
        for k0 in range(0, INTER, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_rows + offs_k[None, :], mask=ok[:, None] & (offs_k < INTER)[None, :], other=0.0)
            w = weight_tile(w_rows, s_base, w_n, n_ok, k0, INTER, stride_sn, stride_sk, a.dtype, WEIGHTS, BLOCK_N,
                            BLOCK_K)  # fmt: skip
            acc = _dot(acc, a, w, IEEE)
    if HAS_BIAS:
        acc += bias_row(b_ptr + e.to(tl.int64) * stride_be, offs_n, n_ok)[None, :]
    out = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=ok[:, None] & n_ok[None, :])
    if COMBINE_LAST:
        counter = counter_ptr + tl.program_id(1)
        if arrive(counter) == arriving - 1:
            reset(counter)
            # the other programs' rows are in L2, not this SM's L1: ".cg"
            total = _weighted_sum(y_ptr, weights_ptr, local_ids, 0, offs_n, H, stride_ym, TOPK, BLOCK_N, ".cg")
            tl.store(out_ptr + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _weighted_sum(
    y_ptr, weights_ptr, local_ids, t, offs, H, stride_ym, TOPK: tl.constexpr, BLOCK: tl.constexpr, CACHE: tl.constexpr
):  # fmt: skip
    """sum over slots s of weight[t, s] * y[t * TOPK + s, offs], in fp32, in slot order; pairs whose
    expert is on another rank add nothing (their y rows were never written)."""
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(TOPK):
        p = t * TOPK + s
        here = (tl.load(local_ids + p) >= 0).to(tl.int32)
        w = tl.load(weights_ptr + p)
        y = tl.load(y_ptr + p.to(tl.int64) * stride_ym + offs, mask=offs < H * here, other=0.0, cache_modifier=CACHE)
        acc += y.to(tl.float32) * w
    return acc


@triton.jit
def moe_combine_kernel(
    y_ptr, weights_ptr, local_ids, out_ptr, H, stride_ym, stride_om,
    TOPK: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[t] = the weighted sum of token t's k expert rows (`_weighted_sum`)."""
    after_producer(PDL)  # pdl.py: the ids and activations come from the step
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = _weighted_sum(y_ptr, weights_ptr, local_ids, t, offs, H, stride_ym, TOPK, BLOCK_H, "")
    tl.store(out_ptr + t.to(tl.int64) * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=offs < H)
