"""`atomc::attention`: write this step's K/V into the paged cache and attend, for a mixed batch.

One opaque op per layer, so Dynamo sees one node and the graph can be cut there. It writes into
`out` (no allocation inside the op), which is what CUDA-graph pieces around it need.

Attention sinks (GPT-OSS): `sinks` [Hq] is a learned logit per query head that joins every query's
softmax denominator and attends to nothing: softmax([q.k * scale..., sink]) with the sink's share
dropped, so a head can put weight "nowhere" and its output shrinks. None (the default, every
dense family) is plain softmax attention, computed by SDPA as before.

FP8 KV cache (`--kv-cache-dtype fp8`): pages of e4m3 hold k / k_scale and v / v_scale (per layer,
per tensor: vLLM's semantics), saturated at ±448; the reads dequantise (stored * scale, in fp32).
The scales come from the forward context beside the caches (`layer_kv_scales`), so the op schemas
and the traced graph are the same for every KV dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atomc.forward_context import AttentionMetadata, layer_cache, layer_kv_scales
from atomc.kv_spec import FP8_KV_DTYPE

FP8_MAX = 448.0  # the largest finite e4m3 value; quantised K/V saturate there

KVScales = tuple[torch.Tensor, torch.Tensor] | None


@torch.library.custom_op("atomc::attention", mutates_args=("out",))
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    layer_idx: int,
    scale: float,
    sliding_window: int = 0,
    sinks: torch.Tensor | None = None,
) -> None:
    """q/out: [T, Hq, D]; k/v: [T, Hkv, D]. Reads the KV cache and batch metadata from the forward context.

    `sliding_window` W > 0: a query at position p sees keys at positions p - W + 1 .. p (Mistral);
    0 is full causal attention. `sinks` [Hq]: per-head sink logits (see the module docstring)."""
    cache = layer_cache(layer_idx)
    if cache is None:
        return attention_without_cache(q, k, v, out, scale, sliding_window, sinks)
    meta, k_cache, v_cache = cache
    scales = fp8_scales(k_cache, layer_kv_scales(layer_idx))
    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, scales)
    paged_attention_reference(q, k_cache, v_cache, out, meta, scale, sliding_window, sinks, scales)


@attention.register_fake
def _(q, k, v, out, layer_idx, scale, sliding_window=0, sinks=None) -> None:
    return None


def attention_without_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    sinks: torch.Tensor | None = None,
) -> None:
    """No KV cache in the forward context (a plain forward, tracing): the batch is one causal sequence."""
    out.copy_(causal_attention(q, k, v, scale, sliding_window, sinks))


def fp8_scales(k_cache: torch.Tensor, scales: KVScales) -> KVScales:
    """The layer's (k_scale, v_scale) when its pages are FP8, None otherwise; FP8 pages without
    scales are an error (the runner always sets them: 1.0 where the checkpoint has none)."""
    if k_cache.dtype != FP8_KV_DTYPE:
        return None
    if scales is None:
        raise ValueError("the KV cache is FP8 (e4m3) but the forward context has no k/v scales for this layer")
    return scales


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """x as the cache stores it: cast, or (FP8, `scale` given) x / scale saturated at ±448, then
    rounded to e4m3 (nearest, ties to even)."""
    if scale is None:
        return x.to(cache_dtype)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Gathered pages as values: stored * scale in fp32 (FP8), or as they are."""
    return x if scale is None else x.float() * scale


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: KVScales = None,
) -> None:
    """Scatter new K/V rows to their slots (slot = block * block_size + offset); slot -1 is padding.
    `scales` (k_scale, v_scale): FP8 pages, quantised as `quantize_kv`."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_scale, v_scale = scales if scales is not None else (None, None)
    k_new = quantize_kv(k[: slot_mapping.numel()][keep], k_cache.dtype, k_scale)
    v_new = quantize_kv(v[: slot_mapping.numel()][keep], v_cache.dtype, v_scale)
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k_new
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v_new


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int, first_block: int = 0) -> torch.Tensor:
    """Tokens first_block * block_size .. length - 1 of one sequence's K or V, [tokens, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    tokens = cache[block_table[first_block:num_blocks].long()].reshape(-1, *cache.shape[2:])
    return tokens[: length - first_block * block_size]


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int) -> torch.Tensor:
    """Causal mask, with a sliding window of `sliding_window` keys when > 0 (broadcasts)."""
    mask = k_pos <= q_pos
    if sliding_window > 0:
        mask = mask & (k_pos > q_pos - sliding_window)
    return mask


def masked_softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, sinks: torch.Tensor | None
) -> torch.Tensor:
    """fp32 attention of q [B, Hq, Lq, D] over k/v [B, Hkv, Lk, D] (GQA: Hq a multiple of Hkv) under a
    boolean `mask` broadcasting to [B, Hq, Lq, Lk]. SDPA without sinks; with them, the softmax
    takes one more logit per head (the sink) whose probability is dropped."""
    q, k, v = q.float(), k.float(), v.float()
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    p = torch.cat([s, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return p @ v


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    q_offset: int,
    sliding_window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [Lq, Hq, D] at absolute positions q_offset.., k/v [Lk, Hkv, D] at 0..; causal (and windowed
    when sliding_window > 0); GQA by repeat."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    lq, lk = q.shape[0], k.shape[0]
    q_pos = torch.arange(q_offset, q_offset + lq, device=q.device)[:, None]
    mask = visible(q_pos, torch.arange(lk, device=q.device)[None, :], sliding_window)
    o = masked_softmax_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, scale, sinks
    )
    return o[0].transpose(0, 1).to(q.dtype)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    return attend(q, k, v, scale, q_offset=0, sliding_window=sliding_window, sinks=sinks)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int = 0,
    sinks: torch.Tensor | None = None,
    kv_scales: KVScales = None,
) -> None:
    """Torch reference for prefill, chunked prefill over a cached prefix, and decode, in one batch.
    `kv_scales` (k_scale, v_scale): the pages are FP8, dequantised as they are gathered.

    Decode rows (one query token) go through one batched call; prefill chunks loop per sequence.
    With a sliding window only the blocks from the one holding the first query's first key are
    read: a windowed KV group releases the blocks before it (their table entries are placeholders)."""
    starts = meta.query_start_loc_host
    page = k_cache.shape[1]
    k_scale, v_scale = kv_scales if kv_scales is not None else (None, None)
    decode_rows = []
    for i, seq_len in enumerate(meta.seq_lens_host):
        qs, qe = starts[i], starts[i + 1]
        if qe - qs == 1:
            decode_rows.append(i)
        elif qe > qs:
            prefix = seq_len - (qe - qs)
            first = max(0, prefix - sliding_window + 1) // page if sliding_window > 0 else 0
            k = dequantize_kv(gather_kv(k_cache, meta.block_tables[i], seq_len, first), k_scale)
            v = dequantize_kv(gather_kv(v_cache, meta.block_tables[i], seq_len, first), v_scale)
            # positions relative to the first gathered key: the masks depend on differences only
            out[qs:qe] = attend(q[qs:qe], k, v, scale, prefix - first * page, sliding_window, sinks)
    if decode_rows:
        decode_attention(q, k_cache, v_cache, out, meta, decode_rows, scale, sliding_window, sinks, kv_scales)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    meta: AttentionMetadata,
    rows: list[int],
    scale: float,
    sliding_window: int = 0,
    sinks: torch.Tensor | None = None,
    kv_scales: KVScales = None,
) -> None:
    """One query token per sequence in `rows`: gather every context into a padded batch, mask, attend.
    The query sits at position len - 1; with a window it sees the last `sliding_window` keys, and
    only the pages that hold them are gathered (the ones before may be placeholders)."""
    page = k_cache.shape[1]
    lens = [meta.seq_lens_host[i] for i in rows]
    longest = max(lens)
    pages = torch.arange((longest + page - 1) // page, device=q.device)[None, :]  # [1, pages]
    if sliding_window > 0:  # each row's pages from the one holding its first key
        first = [max(0, n - sliding_window) // page for n in lens]
        pages = torch.tensor(first, device=q.device)[:, None] + pages[:, : (sliding_window - 1) // page + 2]
    width = meta.block_tables.shape[1]
    tables = meta.block_tables[rows].gather(1, pages.clamp(max=width - 1).expand(len(rows), -1)).long()
    k_scale, v_scale = kv_scales if kv_scales is not None else (None, None)
    k = dequantize_kv(k_cache[tables].flatten(1, 2), k_scale)  # [B, pages * page, Hkv, D]
    v = dequantize_kv(v_cache[tables].flatten(1, 2), v_scale)
    k_pos = (pages[:, :, None] * page + torch.arange(page, device=q.device)).flatten(1)  # past the end: masked
    token = torch.tensor([meta.query_start_loc_host[i] for i in rows], device=q.device)
    last = torch.tensor(lens, device=q.device)[:, None] - 1  # each query's position
    valid = visible(last, k_pos, sliding_window)
    o = masked_softmax_attention(
        q[token].unsqueeze(2),  # [B, Hq, 1, D]
        k.transpose(1, 2),  # [B, Hkv, L, D]
        v.transpose(1, 2),
        valid[:, None, None, :],
        scale,
        sinks,
    )
    out[token] = o.squeeze(2).to(out.dtype)
