"""`atomc::rope_and_write_kv`: RoPE of q/k plus the KV-cache write of (rotated k, v), as one op.

It returns the rotated (q, k); `atomc::paged_attention` consumes them, and that data dependency is
what orders the cache write before the attention that reads it. The cache and slot mapping come from
the forward context, like `atomc::attention`; with no cache set it only rotates.
"""

from __future__ import annotations

import torch

from atomc.forward_context import layer_cache, layer_kv_scales
from atomc.ops.attention import fp8_scales, write_kv_cache
from atomc.ops.norm import rms_norm_reference
from atomc.ops.rope import rope_reference


@torch.library.custom_op("atomc::rope_and_write_kv", mutates_args=())
def rope_and_write_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    layer_idx: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    q_rot, k_rot = rope_reference(positions, q, k, cos_sin_cache)
    cache = layer_cache(layer_idx)
    if cache is not None:
        meta, k_cache, v_cache = cache
        write_kv_cache(k_rot, v, k_cache, v_cache, meta.slot_mapping, fp8_scales(k_cache, layer_kv_scales(layer_idx)))
    return q_rot, k_rot


@rope_and_write_kv.register_fake
def _(positions, q, k, v, cos_sin_cache, layer_idx):
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.custom_op("atomc::qk_norm_rope_and_write_kv", mutates_args=())
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
    """Per-head RMSNorm of q and k over the head dim (Qwen3's q_norm / k_norm), then
    `rope_and_write_kv`: one op, so a backend can do all of it in one pass over q and k."""
    q, k = rms_norm_reference(q, q_weight, q_eps), rms_norm_reference(k, k_weight, k_eps)
    return rope_and_write_kv(positions, q, k, v, cos_sin_cache, layer_idx)


@qk_norm_rope_and_write_kv.register_fake
def _(positions, q, k, v, q_weight, q_eps, k_weight, k_eps, cos_sin_cache, layer_idx):
    return torch.empty_like(q), torch.empty_like(k)
