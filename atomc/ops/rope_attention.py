"""`atomc::rope_paged_attention`: RoPE (after Qwen3's per-head q/k norms, when given), the KV-cache
write and the paged attention of one layer, as one op.

It is `atomc::rope_and_write_kv` (or `qk_norm_rope_and_write_kv`) followed by
`atomc::paged_attention`, so a backend may run all three in one kernel where the step allows it (the
Triton decode kernel rotates q and the new key itself and writes the cache slot it attends to).
The reference body is exactly that pair of ops' bodies. `q_weight` / `k_weight` None: no q/k norm.
"""

from __future__ import annotations

import torch

from atomc.ops.paged_attention import paged_attention
from atomc.ops.rope_kv import qk_norm_rope_and_write_kv, rope_and_write_kv


@torch.library.custom_op("atomc::rope_paged_attention", mutates_args=("out",))
def rope_paged_attention(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None,
    q_eps: float,
    k_weight: torch.Tensor | None,
    k_eps: float,
    out: torch.Tensor,
    layer_idx: int,
    scale: float,
    sliding_window: int = 0,
    sinks: torch.Tensor | None = None,
) -> None:
    """q/out [T, Hq, D], k/v [T, Hkv, D] (before RoPE); the rest as in the two ops it joins."""
    q_rot, k_rot = rotate_and_write(positions, q, k, v, cos_sin_cache, q_weight, q_eps, k_weight, k_eps, layer_idx)
    paged_attention(q_rot, k_rot, v, out, layer_idx, scale, sliding_window, sinks)


def rotate_and_write(positions, q, k, v, cos_sin_cache, q_weight, q_eps, k_weight, k_eps, layer_idx):
    """The first half of the op through the reference ops (the norms only when both weights are given)."""
    if q_weight is not None and k_weight is not None:
        return qk_norm_rope_and_write_kv(positions, q, k, v, q_weight, q_eps, k_weight, k_eps, cos_sin_cache, layer_idx)
    return rope_and_write_kv(positions, q, k, v, cos_sin_cache, layer_idx)


@rope_paged_attention.register_fake
def _(positions, q, k, v, cos_sin_cache, q_weight, q_eps, k_weight, k_eps, out, layer_idx, scale, sliding_window=0,
      sinks=None) -> None:  # fmt: skip
    return None
