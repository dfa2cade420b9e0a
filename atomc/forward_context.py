"""Per-step state the attention op reads: the batch's attention metadata and the layers' KV caches.

Attention is an opaque custom op, so reading this context at run time is invisible to Dynamo; the
compiled graph stays valid for every batch, and CUDA graphs replay against the same static buffers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """A flattened batch of `num_seqs` sequences; sequence i owns query rows
    `query_start_loc[i]:query_start_loc[i+1]` and, after this step, `seq_lens[i]` tokens of KV."""

    slot_mapping: torch.Tensor  # [T] int64, KV slot of each new token (-1 = padding, not written)
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32
    # host copies so the reference path never syncs with the device
    query_start_loc_host: list[int] = field(default_factory=list)
    seq_lens_host: list[int] = field(default_factory=list)
    max_query_len: int = 0
    max_seq_len: int = 0  # may be an upper bound (CUDA graphs): kernels read the real lengths
    num_seqs: int = 0


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None = None
    # per layer (k_cache, v_cache) pages in the layout its backend reads (kernels/registry.py:
    # kv_cache_layout; NHD, [num_blocks, block_size, num_kv_heads, head_dim], for every backend today)
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # per layer, when the layers' KV-cache groups have their own block pools (sliding-window layers
    # beside full ones): the metadata of the layer's group (its block tables and KV slots; the rest
    # is shared). None: every layer reads attn_metadata
    layer_metadata: list[AttentionMetadata] | None = None
    # per layer (k_scale, v_scale), fp32 [1] device tensors, when the pages are FP8 (e4m3): the
    # cache holds k / k_scale, and attention reads stored * k_scale. None: the pages are not FP8
    kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None


def group_context(
    metas: list[AttentionMetadata],
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    layer_group: list[int],
    kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> ForwardContext:
    """The context of a step whose KV groups have metadata `metas` (one per group; `layer_group[l]`
    is layer l's group). One group: the plain context, every layer reads the same metadata."""
    if len(metas) == 1:
        return ForwardContext(metas[0], kv_caches, kv_scales=kv_scales)
    return ForwardContext(metas[0], kv_caches, [metas[g] for g in layer_group], kv_scales)


_current = ForwardContext()


def layer_cache(layer_idx: int) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor] | None:
    """(metadata, k_cache, v_cache) of one layer for this step, or None when no cache is set
    (profiling without a cache, a plain forward): then the batch is one causal sequence."""
    ctx = _current
    if ctx.attn_metadata is None or not ctx.kv_caches:
        return None
    k_cache, v_cache = ctx.kv_caches[layer_idx]
    per_layer = ctx.layer_metadata
    return (ctx.attn_metadata if per_layer is None else per_layer[layer_idx]), k_cache, v_cache


def layer_kv_scales(layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(k_scale, v_scale) of one layer's FP8 pages for this step; None when its pages are not FP8
    (a kernel that finds e4m3 pages and no scales refuses them)."""
    scales = _current.kv_scales
    return None if scales is None else scales[layer_idx]


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext):
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous
