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


@dataclass(frozen=True)
class MLAAttentionSpec:
    """The latent cache of a multi-head latent attention layer (DeepSeek-V2/V3): per token, one
    vector of `kv_lora_rank` normalised latent values then `qk_rope_head_dim` rope'd key values,
    shared by every head (576 values a token for V3, against 2 x 128 heads x 192/128 for full K/V).
    No separate V: the values are the latent itself (the model applies W_UV after attention)."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    sliding_window: None = None  # MLA layers attend to the whole context

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.latent_dim * dtype.itemsize


KVCacheSpec = PagedAttentionSpec | MLAAttentionSpec

# --kv-cache-dtype values: auto (the model's dtype), a float dtype, or FP8. vLLM spells e4m3 both
# "fp8" and "fp8_e4m3"; e5m2 (2 mantissa bits, no scales) is refused rather than half-supported
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32", "fp8", "fp8_e4m3")
FP8_KV_DTYPE = torch.float8_e4m3fn


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the KV pages for `--kv-cache-dtype name`: fp8 / fp8_e4m3 store e4m3 (with a
    per-layer k and v scale, docs/quantization.md), auto the model's dtype."""
    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3"):
        return FP8_KV_DTYPE
    if name == "fp8_e5m2":
        raise ValueError("--kv-cache-dtype fp8_e5m2 is not supported; use fp8 (e4m3, with per-layer scales)")
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return getattr(torch, name)


def canonical_kv_cache_dtype(name: str) -> str:
    """One spelling per stored format (fp8_e4m3 -> fp8), so both give the same compile cache key."""
    return "fp8" if name == "fp8_e4m3" else name


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers whose KV share block ids: one block pool, and one block table per sequence.

    Layers group by their attention window: a full-attention layer needs every block of a sequence,
    a sliding-window layer only the blocks that hold its window, so each kind gets its own pool and
    a windowed group frees a sequence's blocks once they fall behind the window."""

    sliding_window: int | None  # tokens; None = full attention
    layers: tuple[int, ...]


def kv_cache_groups(specs: list[KVCacheSpec | None]) -> list[KVCacheGroup]:
    """The layers' KV groups: full attention first (when any layer has it), then one group per
    window size in order of first appearance. A model with one kind of layer has one group. A None
    spec (a layer another pipeline stage holds) is in no group."""
    by_window: dict[int | None, list[int]] = {}
    for layer, spec in enumerate(specs):
        if spec is None:
            continue
        by_window.setdefault(spec.sliding_window, []).append(layer)
    order = sorted(by_window, key=lambda w: w is not None)  # stable: full first, windows as they come
    return [KVCacheGroup(w, tuple(by_window[w])) for w in order]


def blocks_per_sequence(sliding_window: int | None, num_tokens: int, max_chunk: int, block_size: int) -> int:
    """The most blocks one sequence of `num_tokens` tokens holds at once in a group: all of them for
    full attention; for a window W, the blocks of the chunk being computed (at most `max_chunk`
    tokens) and of the W - 1 keys before its first query, one more for the alignment."""
    every = -(-num_tokens // block_size)
    if sliding_window is None:
        return every
    return min(every, -(-(sliding_window - 1 + min(max_chunk, num_tokens)) // block_size) + 1)
