"""`atomc::mla_attention`: multi-head latent attention (DeepSeek-V2/V3) over the paged latent cache.

MLA caches, per token, one latent vector shared by all heads: c_kv (kv_lora_rank values, already
RMS-normalised) and the rope'd key part k_pe (qk_rope_head_dim values). A head's key is
[c_kv @ W_UK[h].T | k_pe] and its value c_kv @ W_UV[h].T, so with the query's no-rope part folded
through W_UK (q_absorbed[h] = q_nope[h] @ W_UK[h], done by the model) the scores are

    q_absorbed[h] . c_kv + q_pe[h] . k_pe

and the output o[h] = sum_j p_j c_kv_j is still in latent space; the model applies W_UV[h] after.
This "absorbed" form is exact (it reorders the same products), so it serves prefill, chunked
prefill over a cached prefix and decode alike. It is multi-query attention with one shared head
whose key is the whole latent [c_kv | k_pe] and whose value is its c_kv part: the torch reference
below reuses atomc::attention's paged reference that way. The Triton kernel (CUDA and ROCm) is
atomc/kernels/triton/mla_attention.py.

Like atomc::attention it writes into `out` and reads the cache and batch metadata from the forward
context (a context op: the graph is cut here).

FP8 latent cache (`--kv-cache-dtype fp8`): the pages hold [c_kv | k_pe] / scale in e4m3, one scale a
layer for the whole row (the layer's k scale; the forward context's pair is that scale twice,
atomc/runtime/fp8_kv.py), saturated at ±448; the read dequantises the gathered rows (stored * scale,
fp32), for the keys and for the values (the c_kv part) alike.
"""

from __future__ import annotations

import torch

from atomc.forward_context import layer_cache, layer_kv_scales
from atomc.ops.attention import causal_attention, fp8_scales, paged_attention_reference, quantize_kv


@torch.library.custom_op("atomc::mla_attention", mutates_args=("out",))
def mla_attention(
    q_absorbed: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    out: torch.Tensor,
    layer_idx: int,
    scale: float,
) -> None:
    """q_absorbed [T, H, kv_lora], q_pe [T, H, rope], c_kv [T, kv_lora], k_pe [T, rope] (rope'd);
    out [T, H, kv_lora]: the attention output in latent space."""
    cache = layer_cache(layer_idx)
    if cache is None:
        return mla_without_cache(q_absorbed, q_pe, c_kv, k_pe, out, scale)
    q = torch.cat([q_absorbed, q_pe], dim=-1)  # [T, H, kv_lora + rope]
    latent = torch.cat([c_kv, k_pe], dim=-1).unsqueeze(1)  # [T, 1, kv_lora + rope]: one shared "head"
    meta, latent_cache, value_cache = cache  # value_cache: the c_kv part of latent_cache (a view)
    scales = fp8_scales(latent_cache, layer_kv_scales(layer_idx))  # FP8: (latent scale, the same)
    write_latent_cache(latent, latent_cache, meta.slot_mapping, None if scales is None else scales[0])
    paged_attention_reference(q, latent_cache, value_cache, out, meta, scale, kv_scales=scales)


@mla_attention.register_fake
def _(q_absorbed, q_pe, c_kv, k_pe, out, layer_idx, scale) -> None:
    return None


def mla_without_cache(
    q_absorbed: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    """No cache in the forward context (tracing, profiling without a cache): one causal sequence."""
    q = torch.cat([q_absorbed, q_pe], dim=-1)
    latent = torch.cat([c_kv, k_pe], dim=-1).unsqueeze(1)
    out.copy_(causal_attention(q, latent, latent[..., : c_kv.shape[-1]], scale))


def write_latent_cache(
    latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None
) -> None:
    """Scatter new latent rows [T, 1, D] to their slots (block * block_size + offset); -1 is padding.
    `kv_scale` fp32 [1]: FP8 pages, each row stored as `quantize_kv` (rope part included)."""
    keep = slot_mapping >= 0
    rows = quantize_kv(latent[: slot_mapping.numel()][keep], cache.dtype, kv_scale)
    cache.view(-1, *cache.shape[2:])[slot_mapping[keep]] = rows
