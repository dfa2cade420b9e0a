"""Shared inputs and torch references for the Triton kernel tests (CPU interpreter and CUDA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atomc.forward_context import AttentionMetadata
from atomc.ops.attention import paged_attention_reference

# (q_lens, seq_lens) per case; seq_len includes this step's q_len tokens
ATTN_CASES = {
    "prefill": ([5, 17, 1, 33], [5, 17, 1, 33]),
    "chunked_prefill": ([7, 16, 3], [40, 16, 70]),
    "decode": ([1, 1, 1, 1], [1, 15, 64, 150]),
    "mixed": ([1, 9, 1, 20], [37, 9, 100, 52]),
}
# sliding-window cases: (q_lens, seq_lens, window). Windows that are not multiples of the page (16)
# or of the KV tile (64); cached prefixes longer than the window; decode far past the window
WINDOW_CASES = {
    "prefill_w8": ([5, 40, 1, 33], [5, 40, 1, 33], 8),
    "chunked_prefill_w20": ([7, 16, 3], [140, 16, 70], 20),
    "decode_w24": ([1, 1, 1, 1], [1, 15, 200, 300], 24),
    "decode_w1": ([1, 1, 1], [1, 9, 130], 1),
    "mixed_w70": ([1, 9, 1, 20], [37, 9, 260, 152], 70),
}


def make_batch(q_lens, seq_lens, hq, hkv, d, dtype, device, page=16, pad_tokens=2, seed=0):
    """A batch with its K/V already in a shuffled paged cache, plus `pad_tokens` padding rows."""
    g = torch.Generator().manual_seed(seed)
    num_seqs = len(q_lens)
    blocks_per_seq = [(s + page - 1) // page for s in seq_lens]
    max_blocks = max(blocks_per_seq)
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    k_cache = torch.randn(num_blocks, page, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, page, hkv, d, generator=g).to(dtype)
    used = 0
    for i, nb in enumerate(blocks_per_seq):
        block_tables[i, :nb] = perm[used : used + nb].int()
        used += nb
    t = sum(q_lens)
    q = torch.randn(t + pad_tokens, hq, d, generator=g).to(dtype)
    qsl = [0]
    for ql in q_lens:
        qsl.append(qsl[-1] + ql)
    meta = AttentionMetadata(
        slot_mapping=torch.full((t + pad_tokens,), -1, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        query_start_loc_host=qsl,
        seq_lens_host=list(seq_lens),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        num_seqs=num_seqs,
    )
    for i, (ql, sl) in enumerate(zip(q_lens, seq_lens, strict=True)):
        for j in range(ql):
            pos = sl - ql + j
            meta.slot_mapping[qsl[i] + j] = int(block_tables[i, pos // page]) * page + pos % page
    move = lambda x: x.to(device)  # noqa: E731
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        setattr(meta, name, move(getattr(meta, name)))
    return move(q), move(k_cache), move(v_cache), meta


def random_sinks(hq, device="cpu", seed=1):
    """Per-head sink logits around the size of the scaled q.k logits (some well above), so they take
    a real share of each softmax."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(hq, generator=g) * 1.5 + 0.5).to(device)


def attention_reference(q, k_cache, v_cache, meta, scale, sliding_window=0, sinks=None):
    ref = torch.zeros_like(q, dtype=torch.float32)
    paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), ref, meta, scale, sliding_window, sinks)
    return ref


def dense_window_attention(q, k_cache, v_cache, meta, scale, sliding_window, sinks=None):
    """An independent oracle: per sequence, the contiguous K/V read page by page, an explicit
    [q_len, seq_len] mask built position by position, and softmax(q k^T * scale + mask) v in fp64.
    With `sinks` [Hq], each head's row of the softmax gets one more logit whose share is dropped:
    p = exp(s) / (sum exp(s) + exp(sink))."""
    out = torch.zeros_like(q, dtype=torch.float64)
    page = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    qsl = meta.query_start_loc_host
    for i, seq_len in enumerate(meta.seq_lens_host):
        qs, qe = qsl[i], qsl[i + 1]
        if qe == qs:
            continue
        slots = [int(meta.block_tables[i, j // page]) * page + j % page for j in range(seq_len)]
        k = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        mask = torch.full((qe - qs, seq_len), float("-inf"), dtype=torch.float64)
        for r in range(qe - qs):
            p = seq_len - (qe - qs) + r
            for j in range(seq_len):
                if j <= p and (sliding_window <= 0 or p - j < sliding_window):
                    mask[r, j] = 0.0
        s = torch.einsum("qhd,khd->hqk", q[qs:qe].double(), k) * scale + mask
        if sinks is None:
            p = s.softmax(-1)
        else:
            e = (s - s.amax(-1, keepdim=True)).exp()  # every row sees at least its own key
            sink = (sinks.double()[:, None, None] - s.amax(-1, keepdim=True)).exp()
            p = e / (e.sum(-1, keepdim=True) + sink)
        out[qs:qe] = torch.einsum("hqk,khd->qhd", p, v)
    return out


def rms_norm_reference(x, weight, eps):
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight.float() * y.float()).to(x.dtype)


def rope_reference(positions, x, cos_sin):
    cos, sin = cos_sin[positions].float().unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def cos_sin_cache(max_pos, d, device):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


def silu_and_mul_reference(x):
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def make_moe(t, e, h, inter, k, dtype, device, *, bias=False, seed=0, skewed=False):
    """x, router logits (in x's dtype) and stacked expert weights (w13 [E, 2I, H] gate then up,
    w2 [E, H, I]), drawn on `device`, scaled so activations stay O(1). `skewed`: experts past the
    first half never win and expert 0 wins often (uneven loads, experts with no token)."""
    g = torch.Generator(device).manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, device=device)  # noqa: E731
    x = rand(t, h).to(dtype)
    logits = rand(t, e)
    if skewed:
        logits[:, e // 2 :] -= 30.0
        logits[:, 0] += 2.0
    w13 = (rand(e, 2 * inter, h) / h**0.5).to(dtype)
    w2 = (rand(e, h, inter) / inter**0.5).to(dtype)
    b13 = (0.5 * rand(e, 2 * inter)).to(dtype) if bias else None
    b2 = (0.5 * rand(e, h)).to(dtype) if bias else None
    return x, logits.to(dtype), w13, w2, b13, b2


def release_behind_window(meta, k_cache, v_cache, window, fill):
    """A windowed KV group's view of `meta`: each sequence's table entries for blocks wholly before
    its first query's window point at one unused block filled with `fill` (the null block), as the
    scheduler leaves them. Returns that metadata (None when no block lies behind a window); `meta`
    keeps the real tables."""
    import dataclasses

    page = k_cache.shape[1]
    used = {int(b) for b in meta.block_tables.flatten()}
    null = next(b for b in range(k_cache.shape[0]) if b not in used)
    k_cache[null], v_cache[null] = fill, fill
    tables = meta.block_tables.clone()
    qsl = meta.query_start_loc_host
    for i, seq_len in enumerate(meta.seq_lens_host):
        first_query = seq_len - (qsl[i + 1] - qsl[i])
        tables[i, : max(0, first_query - window + 1) // page] = null
    if not (tables == null).any():
        return None
    return dataclasses.replace(meta, block_tables=tables)


class LaunchRecorder:
    """Stands in for a Triton kernel's launcher: records each launch's grid, then launches (a test
    that a kernel was, or was not, launched)."""

    def __init__(self, kernel, launched: list):
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, grid):
        self.launched.append(grid)
        return self.kernel[grid]


# (experts, k, scoring, bias, groups, kept groups, renormalise, scale): DeepSeek-V3 (sigmoid, bias,
# 8 groups of 32 keeping 4, the sum of each group's best two), V2 (softmax, 160 in 8 groups of 20:
# not a power of two, keeping 3, the group's best), a bias without groups, and one group
DEEPSEEK_ROUTINGS = [
    (256, 8, "sigmoid", True, 8, 4, True, 2.5),
    (160, 6, "softmax", False, 8, 3, False, 16.0),
    (64, 6, "sigmoid", True, 0, 0, True, 1.0),
    (24, 4, "softmax", False, 1, 1, True, 1.0),
]


def routing_lower_id_on_ties(logits, top_k, scoring, renormalize, correction_bias, groups, keep, scale):
    """select_experts' routing with every tie broken towards the lower id, as the routing kernels
    break them (torch.topk's order among equal values is unspecified): stable descending sorts of the
    group scores and of the masked scores."""
    logits = logits.float()
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    choose = scores if correction_bias is None else scores + correction_bias.float()
    t, e = choose.shape
    if groups > 0:
        grouped = choose.view(t, groups, e // groups)
        if correction_bias is not None:
            group_score = grouped.sort(dim=-1, descending=True, stable=True).values[..., :2].sum(-1)
        else:
            group_score = grouped.max(-1).values
        kept = group_score.sort(dim=-1, descending=True, stable=True).indices[:, :keep]
        mask = torch.zeros(t, groups, dtype=torch.bool, device=choose.device).scatter_(1, kept, True)
        choose = choose.masked_fill(~mask.repeat_interleave(e // groups, dim=1), float("-inf"))
    ids = choose.sort(dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * scale, ids.to(torch.int32)
