"""`torch.ops.atomc_aiter.*` for attention and the KV-cache write (ROCm). UNTESTED ON AMD HARDWARE:
checked only against the stand-in `aiter` of tests/kernels/fake_aiter.py, on CPU.

The cache stays atomc's NHD pages `[blocks, page, kv_heads, head_dim]`: every AITER entry used here
reads or writes that layout as it is, so the allocator needs nothing AITER-specific.

- KV write: `reshape_and_cache_flash` (NHD).
- Decode batches (max_query_len == 1): `paged_attention_v1`, the HIP kernel, told "NHD". It splits
  each context into 256-token partitions; `sliding_window` (AITER >= the release that added it)
  masks keys at or before p - W, as atomc does, but reads the whole context.
- Batches with prefill rows: `flash_attn_varlen_func` with `block_table` over the same pages and
  `causal=True` (bottom-right aligned, so chunked prefill over a cached prefix works);
  `window_size=(W - 1, 0, 0)` for a window (left keys, right keys, sink). Its CK kernel requires a
  page size divisible by 128 (atomc's default is 16): with smaller pages, and for dtypes AITER's
  attention does not take (fp32), the op runs ROCm's next backend (Triton, else the reference).
- Attention sinks (GPT-OSS's per-head sink logits): neither entry above is given them here
  (paged_attention_v1 has no such argument; flash_attn_varlen_func's `sink_ptr` is not wired or
  checked against AMD hardware), so a layer with sinks runs ROCm's next backend (Triton, which
  folds the sink in, else the reference).
- Q/K norms (Qwen3): AITER's fused qk-norm + RoPE + cache entry writes V in a non-NHD layout and
  takes one eps, so the norms run as `rmsnorm2d_fwd` over head rows, then the RoPE and the write.

Host values (CUDA graphs): the wrappers read only the metadata's host ints, `max_query_len`,
`max_seq_len` and `num_seqs`, which a captured graph holds as fixed upper bounds (as the Triton path
does). `paged_attention_v1` sizes its partitions and workspace from `max_seq_len`: a bound costs
scratch memory, not correctness (partitions past a sequence's length exit). The workspace comes
from torch's allocator on each call (the graph pool under capture). Nothing syncs with the device.
Graph capture of these kernels has not been run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atomc.forward_context import AttentionMetadata, layer_cache
from atomc.kernels.aiter.fallback import NextBackend
from atomc.kernels.aiter.ops import rope_rows
from atomc.kernels.binding import bind_as_atomc
from atomc.ops.attention import attention_without_cache

PARTITION = 256  # paged_attention_v1's partition size (tokens)
AITER_DTYPES = (torch.float16, torch.bfloat16)  # what AITER's attention kernels take
VARLEN_PAGE_MULTIPLE = 128  # CK's paged varlen kernel: "block size must be divisible by 128"


def _aiter():
    import aiter

    return aiter


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache, v_cache, slot_mapping: torch.Tensor) -> None:
    one = torch.ones(1, dtype=torch.float32, device=k.device)
    _aiter().reshape_and_cache_flash(
        key=k,
        value=v,
        key_cache=k_cache,
        value_cache=v_cache,
        slot_mapping=slot_mapping,
        kv_cache_dtype="auto",
        k_scale=one,
        v_scale=one,
    )


def decode(q, k_cache, v_cache, out, meta: AttentionMetadata, scale: float, sliding_window: int) -> None:
    """One query token per sequence: paged_attention_v1 over NHD pages."""
    n = meta.num_seqs
    heads, head_dim = q.shape[1], q.shape[2]
    partitions = max(1, -(-meta.max_seq_len // PARTITION))
    # partial outputs [n, Hq, partitions, D] in q's dtype, then fp32 exp sums and max logits
    nbytes = n * heads * partitions * (head_dim * q.element_size() + 2 * 4)
    workspace = torch.empty(nbytes, dtype=torch.uint8, device=q.device)
    one = torch.ones(1, dtype=torch.float32, device=q.device)
    window = {"sliding_window": sliding_window} if sliding_window > 0 else {}  # older AITER lacks it
    _aiter().paged_attention_v1(
        out=out,
        workspace_buffer=workspace,
        query=q,
        key_cache=k_cache,
        value_cache=v_cache,
        scale=scale,
        block_tables=meta.block_tables[:n],
        cu_query_lens=meta.query_start_loc[: n + 1],
        context_lens=meta.seq_lens[:n],
        max_context_len=meta.max_seq_len,
        alibi_slopes=None,
        kv_cache_dtype="auto",
        kv_cache_layout="NHD",
        logits_soft_cap=0.0,
        k_scale=one,
        v_scale=one,
        fp8_out_scale=None,
        partition_size=PARTITION,
        **window,
    )


def varlen(q, k_cache, v_cache, out, meta: AttentionMetadata, scale: float, sliding_window: int) -> None:
    """Any mix of prefill, chunked prefill and decode: flash_attn_varlen_func over the paged cache."""
    n = meta.num_seqs
    seq_lens = meta.seq_lens[:n]
    cu_seqlens_k = F.pad(torch.cumsum(seq_lens, 0, dtype=torch.int32), (1, 0))
    window = (sliding_window - 1, 0, 0) if sliding_window > 0 else (-1, -1, 0)
    _aiter().flash_attn_varlen_func(
        q=q,
        k=k_cache,
        v=v_cache,
        cu_seqlens_q=meta.query_start_loc[: n + 1],
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=meta.max_query_len,
        max_seqlen_k=meta.max_seq_len,
        softmax_scale=scale,
        causal=True,
        window_size=window,
        block_table=meta.block_tables[:n],
        out=out,
    )


# ROCm's next backend for atomc::paged_attention (fallback.py; the cache write, if any, is done):
# next_backend(q, k, v, out, layer_idx, scale, sliding_window, sinks)
next_backend = NextBackend("atomc_aiter attention")
set_next_backend = next_backend.set


def attend(q, k, v, out, layer_idx, scale, sliding_window, sinks=None) -> None:
    cache = layer_cache(layer_idx)
    if cache is None:
        return attention_without_cache(q, k, v, out, scale, sliding_window, sinks)
    meta, k_cache, v_cache = cache
    if meta.num_seqs == 0:
        return
    page = k_cache.shape[1]
    unsupported = sinks is not None or q.dtype not in AITER_DTYPES
    if unsupported or (meta.max_query_len > 1 and page % VARLEN_PAGE_MULTIPLE):
        return next_backend(q, k, v, out, layer_idx, scale, sliding_window, sinks)
    q = q.contiguous()
    if meta.max_query_len == 1:
        decode(q, k_cache, v_cache, out, meta, scale, sliding_window)
    else:
        varlen(q, k_cache, v_cache, out, meta, scale, sliding_window)


@bind_as_atomc("atomc_aiter", "paged_attention")
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    layer_idx: int,
    scale: float,
    sliding_window: int = 0,
    sinks: torch.Tensor | None = None,
) -> None:
    attend(q, k, v, out, layer_idx, scale, sliding_window, sinks)


@bind_as_atomc("atomc_aiter", "attention")
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
    cache = layer_cache(layer_idx)
    if cache is not None:
        meta, k_cache, v_cache = cache
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    attend(q, k, v, out, layer_idx, scale, sliding_window, sinks)


def rope_then_write(positions, q, k, v, cos_sin_cache, layer_idx):
    q_rot, k_rot = rope_rows(positions, q, k, cos_sin_cache)
    cache = layer_cache(layer_idx)
    if cache is not None:
        meta, k_cache, v_cache = cache
        write_kv(k_rot, v, k_cache, v_cache, meta.slot_mapping)
    return q_rot, k_rot


@bind_as_atomc("atomc_aiter", "rope_and_write_kv")
def rope_and_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    layer_idx: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    # two AITER kernels (RoPE, then the cache write): no fused RoPE + NHD cache-write entry
    return rope_then_write(positions, q, k, v, cos_sin_cache, layer_idx)


def _head_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # one row per (token, head)
    return _aiter().rmsnorm2d_fwd(input=rows, weight=weight, epsilon=eps).view(x.shape)


@bind_as_atomc("atomc_aiter", "qk_norm_rope_and_write_kv")
def qk_norm_rope_and_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor,
    q_eps: float,
    k_weight: torch.Tensor,
    k_eps: float,
    cos_sin_cache: torch.Tensor,
    layer_idx: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = _head_norm(q, q_weight, q_eps), _head_norm(k, k_weight, k_eps)
    return rope_then_write(positions, q, k, v, cos_sin_cache, layer_idx)
