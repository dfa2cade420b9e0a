"""`torch.ops.atomc_aiter::mla_attention`: atomc::mla_attention (absorbed multi-head latent attention,
DeepSeek-V2/V3) on AITER's MLA kernels (ROCm). NEVER RUN ON AMD HARDWARE: the calls follow AITER's
source (aiter/mla.py, aiter/ops/cache.py) with keyword arguments, and are checked only against the
stand-in `aiter` of tests/kernels/fake_aiter.py, on CPU.

The cache stays atomc's latent pages `[blocks, page, 1, kv_lora + rope]` (one KV head shared by all
query heads; its first kv_lora values are the value). AITER's MLA kernels take that memory as
`kv_buffer [pages, page_size, nhead_kv=1, kv_lora + rope]`; it is passed as page_size 1 (a view,
`[blocks * page, 1, 1, D]`) with token-level indices: `kv_indptr` the offsets of each sequence's
tokens in `kv_indices`, `kv_indices` the cache row of each token, `kv_last_page_lens` ones. Page
size 1 is what AITER's MLA tests run by default and what every decode variant takes (some take only
1 or 64); it costs one int32 index per token against 1152 bytes of bf16 latent read. The indices are
built on the device from the block table, sized by its capacity (no host sync, no data-dependent
shape), sized `num_seqs x max_seq_len` (a host bound, fixed under CUDA graphs); AITER also reads
`kv_indices.numel()` as the batch's KV total for its split heuristic, so the bound may choose more
KV splits than the real lengths would (speed, not results). They are rebuilt in every layer (a few
small kernels over num_seqs x max_seq_len int32s); building them once a step belongs in the
metadata builder.

- cache write: `concat_and_cache_mla` ([c_kv | k_pe] into `[blocks, page, D]` at slot_mapping).
- decode batches (max_query_len == 1): `mla_decode_fwd` (split-KV, then its reduce).
- batches with prefill rows (prefill, chunked prefill over a cached prefix, decode rows beside
  them): `mla_prefill_fwd`, AITER's absorbed causal prefill (its asm kernels are named
  `mla_pfl_bf16_a16w16_causal_*`; AITER's test checks it against a bottom-right aligned causal
  reference with prefixes). Not `flash_attn_varlen_func` over the latent as one KV head: CK's fmha
  kernels take head sizes up to 256 (192/128 for DeepSeek's expanded per-head form), not the
  latent's 576 keys and 512 values.

What these kernels do not take runs on ROCm's next backend (Triton, else the reference), decided
per call from shapes and dtypes (static in a traced graph): dtypes other than bf16 (AITER's MLA
asm kernels are bf16 or fp8), head counts other than 16 and 128 (the ratios for which AITER has
both its prefill and decode kernels, on gfx942 and gfx950; 128 heads is V3 on one GPU, 16 V2-Lite
or V3 over 8), widths other than kv_lora 512 + rope 64 (the kernels are built for DeepSeek's), and
a forward without a cache.

Host values: only `max_query_len` and `max_seq_len` (fixed bounds under CUDA graphs, as for the
MHA wrappers); the workspaces come from torch's allocator inside AITER's wrappers. Graph capture
has not been run.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from atomc.forward_context import AttentionMetadata, layer_cache
from atomc.kernels.aiter.fallback import NextBackend
from atomc.kernels.binding import bind_as_atomc

MLA_DTYPES = (torch.bfloat16,)
MLA_HEADS = (16, 128)
MLA_WIDTHS = (512, 64)  # (kv_lora_rank, qk_rope_head_dim)


def _aiter():
    import aiter

    return aiter


def _mla():
    return importlib.import_module("aiter.mla")  # the MLA entry points live in a submodule


def aiter_declines(q_absorbed: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor) -> str | None:
    """Why AITER's MLA kernels cannot run this call (None when they can)."""
    if q_absorbed.dtype not in MLA_DTYPES or latent_cache.dtype != q_absorbed.dtype:
        return f"dtype {q_absorbed.dtype} (cache {latent_cache.dtype}): AITER's MLA kernels take bf16"
    if q_absorbed.shape[1] not in MLA_HEADS:
        return f"{q_absorbed.shape[1]} heads: AITER's MLA prefill and decode kernels exist for {MLA_HEADS}"
    if (q_absorbed.shape[-1], q_pe.shape[-1]) != MLA_WIDTHS:
        return f"kv_lora {q_absorbed.shape[-1]} + rope {q_pe.shape[-1]}: the kernels are built for 512 + 64"
    return None


def write_latent(c_kv: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor, slot_mapping) -> None:
    blocks, page, _, dim = latent_cache.shape
    _aiter().concat_and_cache_mla(
        kv_c=c_kv,
        k_pe=k_pe,
        kv_cache=latent_cache.view(blocks, page, dim),
        slot_mapping=slot_mapping,
        kv_cache_dtype="auto",
        scale=torch.ones(1, dtype=torch.float32, device=c_kv.device),
    )


def token_indices(meta: AttentionMetadata, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_indptr [n+1], kv_indices): each sequence's cache rows (block * page + offset) in order,
    packed; kv_indices is sized n x max_seq_len rounded up to pages (the tail past kv_indptr[n]
    unused), from the host bound max_seq_len, not the batch's device lengths."""
    n = meta.num_seqs
    seq_lens = meta.seq_lens[:n]
    tables = meta.block_tables[:n, : -(-meta.max_seq_len // page)]
    kv_indptr = F.pad(torch.cumsum(seq_lens, 0, dtype=torch.int32), (1, 0))
    cap = tables.shape[1] * page
    j = torch.arange(cap, dtype=torch.int32, device=tables.device)
    rows = tables[:, j // page] * page + j % page  # [n, cap]
    # row j of sequence i goes to kv_indptr[i] + j; rows past a sequence's length to one spare slot
    dest = torch.where(j < seq_lens[:, None], kv_indptr[:-1, None] + j, n * cap)
    kv_indices = torch.empty(n * cap + 1, dtype=torch.int32, device=tables.device)
    kv_indices.scatter_(0, dest.flatten().long(), rows.flatten().to(torch.int32))
    return kv_indptr, kv_indices[: n * cap]


def attend(q: torch.Tensor, latent_cache: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata, scale: float):
    n = meta.num_seqs
    kv_indptr, kv_indices = token_indices(meta, latent_cache.shape[1])
    args = dict(
        q=q,
        kv_buffer=latent_cache.view(-1, 1, 1, latent_cache.shape[-1]),  # page size 1
        o=out,
        qo_indptr=meta.query_start_loc[: n + 1],
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
        kv_last_page_lens=torch.ones(n, dtype=torch.int32, device=q.device),
        max_seqlen_q=meta.max_query_len,
        sm_scale=scale,
    )
    if meta.max_query_len == 1:
        _mla().mla_decode_fwd(**args, page_size=1, nhead_kv=1)
    else:
        _mla().mla_prefill_fwd(**args)


# ROCm's next backend for what AITER declines (fallback.py)
next_backend = NextBackend("atomc_aiter::mla_attention")
set_next_backend = next_backend.set


@bind_as_atomc("atomc_aiter", "mla_attention")
def mla_attention(
    q_absorbed: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    out: torch.Tensor,
    layer_idx: int,
    scale: float,
) -> None:
    cache = layer_cache(layer_idx)
    if cache is None or aiter_declines(q_absorbed, q_pe, cache[1]) is not None:
        return next_backend(q_absorbed, q_pe, c_kv, k_pe, out, layer_idx, scale)
    meta, latent_cache, _ = cache  # the value cache is a view of the latent's first kv_lora values
    write_latent(c_kv, k_pe, latent_cache, meta.slot_mapping)
    if meta.num_seqs == 0:
        return
    q = torch.cat([q_absorbed, q_pe], dim=-1)  # [T, H, kv_lora + rope], contiguous as the kernels need
    o = out if out.is_contiguous() else torch.empty_like(out)
    attend(q, latent_cache, o, meta, scale)
    if o is not out:
        out.copy_(o)
