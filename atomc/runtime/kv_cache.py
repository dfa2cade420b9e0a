"""KV-cache storage, sized and allocated from the model's per-layer specs (`model.kv_cache_specs()`).

Every layer gets a K and a V tensor of pages; what a page holds comes from the layer's spec
(`atomc/kv_spec.py`) and its physical layout from the attention backend
(`atomc/kernels/registry.py: kv_cache_layout`), so a backend with its own page layout, or a model
whose layers differ (sliding next to full attention, an MLA latent), needs no change here. Layers
with equal specs and layout share one allocation, viewed per layer: fewer allocator segments, one
pointer to reason about. All layers share the block ids: block b of every layer belongs to the
same sequence, so one block table serves all layers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from atomc.kv_spec import KVCacheSpec


def page_shape(layout: str, num_blocks: int, block_size: int, spec: KVCacheSpec) -> tuple[int, ...]:
    """Shape of one layer's K (or V) tensor of `num_blocks` pages in `layout`."""
    if layout == "NHD":  # [blocks, tokens of a page, kv heads, head dim]
        return (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    raise ValueError(f"unknown KV-cache page layout {layout!r}")


def bytes_per_block(specs: Sequence[KVCacheSpec], block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block id costs across all layers (K and V)."""
    return sum(spec.bytes_per_token(dtype) for spec in specs) * block_size


def allocate_kv_cache(
    specs: Sequence[KVCacheSpec],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device,
    layout_of: Callable[[KVCacheSpec], str],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_cache, v_cache), `num_blocks` pages each, in the layout `layout_of(spec)`."""
    groups: dict[tuple[KVCacheSpec, str], list[int]] = {}
    for layer, spec in enumerate(specs):
        groups.setdefault((spec, layout_of(spec)), []).append(layer)
    caches: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(specs)
    for (spec, layout), layers in groups.items():
        shape = page_shape(layout, num_blocks, block_size, spec)
        pool = torch.zeros(len(layers), 2, *shape, dtype=dtype, device=device)
        for i, layer in enumerate(layers):
            caches[layer] = (pool[i, 0], pool[i, 1])
    return caches  # type: ignore[return-value]  (every layer is in one group)
