"""`atomc::paged_attention`: attention that only reads the paged KV cache (the write happened in
`atomc::rope_and_write_kv`). k/v are taken for two reasons: the data dependency on the write, and
the no-cache path (profiling, plain forward), where the batch is one causal sequence."""

from __future__ import annotations

import torch

from atomc.forward_context import layer_cache, layer_kv_scales
from atomc.ops.attention import attention_without_cache, fp8_scales, paged_attention_reference


@torch.library.custom_op("atomc::paged_attention", mutates_args=("out",))
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
    """`sliding_window` and `sinks` as in `atomc::attention` (0 = full causal attention, None = no sinks)."""
    cache = layer_cache(layer_idx)
    if cache is None:
        return attention_without_cache(q, k, v, out, scale, sliding_window, sinks)
    meta, k_cache, v_cache = cache
    scales = fp8_scales(k_cache, layer_kv_scales(layer_idx))
    paged_attention_reference(q, k_cache, v_cache, out, meta, scale, sliding_window, sinks, scales)


@paged_attention.register_fake
def _(q, k, v, out, layer_idx, scale, sliding_window=0, sinks=None) -> None:
    return None
