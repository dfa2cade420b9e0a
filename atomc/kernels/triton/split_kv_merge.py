"""Merging split-KV attention partials (paged_attention.py): the sink logit folded into a softmax,
and the merge of a q block's segments (by the reduce kernel, or in the attention kernel by the
last segment program to arrive: arrivals.py).

Each segment program leaves, per query row, its running max m (log2 domain), its sum l and its
unnormalised fp32 accumulator; the merge weighs each by exp2(m - max m) and divides once.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fold_sink(sinks_ptr, head, m_i, l_i, acc):
    # the sink logit (natural log domain, like the scaled q.k) as one more key with no value;
    # m_i / l_i are in the log2 domain the kernels keep
    sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
    m_new = tl.maximum(m_i, sink)  # finite: a row with no keys still has its sink
    alpha = tl.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.exp2(sink - m_new), acc * alpha[:, None]


@triton.jit
def merge_partials(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, sinks_ptr, tok, head, row_ok, used, stride_ot, stride_oh, col0,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ACC_COLS: tl.constexpr,
    NUM_Q_HEADS: tl.constexpr, NUM_SEGMENTS: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    """The rows' output columns [col0, col0 + BLOCK_D) from the partials of their first `used`
    segments (the reduce kernels' body, and the attention kernel's last segment program with
    MERGE_LAST). A partial row holds ACC_COLS values: BLOCK_D where one program merges a whole
    head (col0 0), the latent's width where MLA's merge takes it a column piece a program. Other
    programs wrote the partials: ".cg" reads them from L2, past this SM's L1."""
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = col0 + tl.arange(0, BLOCK_D)
    base = (tok * NUM_Q_HEADS + head) * NUM_SEGMENTS
    idx = base[:, None] + offs_s[None, :]
    wrote = row_ok[:, None] & (offs_s < used)[None, :]
    m = tl.load(part_m_ptr + idx, mask=wrote, other=float("-inf"), cache_modifier=".cg")
    lsum = tl.load(part_l_ptr + idx, mask=wrote, other=0.0, cache_modifier=".cg")
    m_max = tl.max(m, 1)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max[:, None])  # a segment with no visible key (m = -inf) weighs 0
    denom = tl.sum(w * lsum, 1)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in range(0, used):
        a = tl.load(
            part_acc_ptr + (base + s)[:, None] * ACC_COLS + offs_d[None, :], mask=row_ok[:, None], other=0.0,
            cache_modifier=".cg",
        )  # fmt: skip
        w_s = tl.sum(tl.where(offs_s[None, :] == s, w, 0.0), 1)
        acc += a * w_s[:, None]
    if SINKS:
        _, denom, acc = fold_sink(sinks_ptr, head, m_max, denom, acc)
    denom = tl.where(denom > 0, denom, 1.0)  # no key at all (a graph's padding sequence): zeros
    o = acc / denom[:, None]
    o_rows = tok * stride_ot + head * stride_oh
    tl.store(
        out_ptr + o_rows[:, None] + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :],
    )
