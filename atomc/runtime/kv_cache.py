"""KV-cache storage: one [num_blocks, block_size, num_kv_heads, head_dim] tensor for K and one for V
per layer (NHD pages), sized from a memory budget."""

from __future__ import annotations

import torch


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str | torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # one allocation, viewed per layer: fewer allocator segments, one pointer to reason about
    pool = torch.zeros(
        num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
    )
    return [(pool[i, 0], pool[i, 1]) for i in range(num_layers)]
