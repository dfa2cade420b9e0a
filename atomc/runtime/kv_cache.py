"""KV-cache storage, sized and allocated from the model's per-layer specs (`model.kv_cache_specs()`).

Every layer gets a K and a V tensor of pages; what a page holds comes from the layer's spec
(`atomc/kv_spec.py`) and its physical layout from the attention backend
(`atomc/kernels/registry.py: kv_cache_layout`), so a backend with its own page layout, or a model
whose layers differ (sliding next to full attention, an MLA latent), needs no change here. Layers
with equal specs and layout share one allocation, viewed per layer: fewer allocator segments, one
pointer to reason about.

Block ids are per KV-cache group (`atomc/kv_spec.py: kv_cache_groups`): the layers of one group
share them (block b of each of its layers belongs to the same sequence, so one block table serves
the group), and each group has its own pool, of its own size. `split_kv_blocks` divides the memory
between the groups by what one sequence of `max_model_len` tokens needs in each: a sliding-window
group needs only its window and a chunk, so most of the memory goes to the full-attention layers
and more sequences fit than if every layer kept every block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from atomc.kv_spec import KVCacheSpec, MLAAttentionSpec


def page_shape(layout: str, num_blocks: int, block_size: int, spec: KVCacheSpec) -> tuple[int, ...]:
    """Shape of one layer's K (or V) tensor of `num_blocks` pages in `layout` (an MLA layer's: its
    latent pages, one "head" of kv_lora_rank + rope values)."""
    if layout == "NHD":  # [blocks, tokens of a page, kv heads, head dim]
        if isinstance(spec, MLAAttentionSpec):
            return (num_blocks, block_size, 1, spec.latent_dim)
        return (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    raise ValueError(f"unknown KV-cache page layout {layout!r}")


def bytes_per_block(specs: Sequence[KVCacheSpec | None], block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block id costs across all layers (K and V); None (another pipeline stage's layer)
    costs nothing here."""
    return sum(spec.bytes_per_token(dtype) for spec in specs if spec is not None) * block_size


def split_kv_blocks(budget: int, per_block: Sequence[int], needs: Sequence[int], nulls: Sequence[int]) -> list[int]:
    """Blocks per group for `budget` bytes: each group in proportion to `needs[g]`, the blocks one
    sequence of max_model_len holds at once in it (`atomc/kv_spec.py: blocks_per_sequence`), plus its
    `nulls[g]` reserved blocks (a windowed pool's null block). `per_block[g]`: bytes of one block of
    group g over its layers. One group takes all: budget // per_block, as before groups existed."""
    if len(per_block) == 1:
        return [budget // per_block[0]]
    reserved = sum(n * b for n, b in zip(nulls, per_block, strict=True))
    unit = sum(n * b for n, b in zip(needs, per_block, strict=True))  # bytes of one longest sequence
    seqs = max(budget - reserved, 0) / unit
    return [int(seqs * n) + r for n, r in zip(needs, nulls, strict=True)]


def scale_kv_blocks(first: int, needs: Sequence[int], nulls: Sequence[int]) -> list[int]:
    """Blocks per group when the first group's pool is given (`--num-kv-blocks`): the others in
    proportion to their needs (rounded up), plus their reserved blocks."""
    usable = first - nulls[0]
    return [first] + [-(-usable * n // needs[0]) + r for n, r in zip(needs[1:], nulls[1:], strict=True)]


def allocate_kv_cache(
    specs: Sequence[KVCacheSpec | None],
    num_blocks: int | Sequence[int],
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device,
    layout_of: Callable[[KVCacheSpec], str],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_cache, v_cache), `num_blocks` pages each (one count, or one per layer), in the
    layout `layout_of(spec)`. An MLA layer has one latent tensor: its k_cache is the latent pages
    [.., kv_lora_rank + rope] and its v_cache a view of their first kv_lora_rank values (no memory
    of its own: the latent is both the key's and the value's source). A None spec (a layer another
    pipeline stage holds) gets None: no pages in this process."""
    counts = [num_blocks] * len(specs) if isinstance(num_blocks, int) else list(num_blocks)
    groups: dict[tuple[KVCacheSpec, str, int], list[int]] = {}
    for layer, spec in enumerate(specs):
        if spec is None:
            continue
        groups.setdefault((spec, layout_of(spec), counts[layer]), []).append(layer)
    caches: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(specs)
    for (spec, layout, count), layers in groups.items():
        shape = page_shape(layout, count, block_size, spec)
        if isinstance(spec, MLAAttentionSpec):
            latent = torch.zeros(len(layers), *shape, dtype=dtype, device=device)
            for i, layer in enumerate(layers):
                caches[layer] = (latent[i], latent[i, ..., : spec.kv_lora_rank])
            continue
        pool = torch.zeros(len(layers), 2, *shape, dtype=dtype, device=device)
        for i, layer in enumerate(layers):
            caches[layer] = (pool[i, 0], pool[i, 1])
    return caches  # type: ignore[return-value]  (every held layer is in one group)
