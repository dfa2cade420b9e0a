"""What each layer keeps in the KV cache, as the model declares it (`model.kv_cache_specs()`).

The runtime sizes and allocates the cache from these specs; the attention backend picks the
physical layout of each layer's pages (`atomc/kernels/registry.py: kv_cache_layout`). A spec is a
plain frozen dataclass, so it can cross a process boundary and enter a cache key as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedAttentionSpec:
    """Paged K and V of an MHA/GQA layer: per token, `num_kv_heads x head_dim` values each.

    `sliding_window` (tokens, None = full attention): a query at position p attends to keys at
    positions p - sliding_window + 1 .. p only."""

    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_kv_heads * self.head_dim * dtype.itemsize


KVCacheSpec = PagedAttentionSpec  # MLA's latent spec joins this union with its models
