"""KV-cache sizing and allocation from per-layer specs (runtime/kv_cache.py), the page layout from
the attention backend (kernels/registry.py)."""

from __future__ import annotations

import pytest
import torch

from atomc.kernels.registry import kv_cache_layout
from atomc.kv_spec import KVCacheGroup, PagedAttentionSpec, blocks_per_sequence, kv_cache_groups
from atomc.runtime.kv_cache import allocate_kv_cache, bytes_per_block, scale_kv_blocks, split_kv_blocks

FULL = PagedAttentionSpec(num_kv_heads=2, head_dim=8)
WIDE = PagedAttentionSpec(num_kv_heads=4, head_dim=16)
WINDOW = PagedAttentionSpec(num_kv_heads=2, head_dim=8, sliding_window=64)


def test_mixed_specs_get_their_own_shapes_and_equal_specs_share_a_pool():
    specs = [FULL, WIDE, FULL, WINDOW, WIDE]
    layouts = []
    caches = allocate_kv_cache(specs, 5, 4, torch.float16, "cpu", layout_of=lambda s: layouts.append(s) or "NHD")
    assert layouts == specs  # the backend is asked for every layer
    for (k, v), spec in zip(caches, specs, strict=True):
        assert k.shape == v.shape == (5, 4, spec.num_kv_heads, spec.head_dim)
        assert k.dtype == torch.float16 and not k.any()
    storage = [k.untyped_storage().data_ptr() for k, _ in caches]
    assert storage[0] == storage[2] and storage[1] == storage[4]  # one allocation per distinct spec
    assert len({storage[0], storage[1], storage[3]}) == 3
    k0, v0 = caches[0]
    k0.fill_(1)
    assert not v0.any() and not caches[2][0].any()  # views of one pool, but disjoint
    per_token = sum(2 * s.num_kv_heads * s.head_dim * 2 for s in specs)
    assert bytes_per_block(specs, 4, torch.float16) == 4 * per_token


def test_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="unknown KV-cache page layout 'HND'"):
        allocate_kv_cache([FULL], 2, 4, torch.float32, "cpu", layout_of=lambda s: "HND")


def test_every_backend_reads_nhd_pages_today():
    for platform in ("cpu", "cuda", "rocm"):
        assert kv_cache_layout(platform, FULL) == "NHD"
    with pytest.raises(ValueError, match="unknown platform"):
        kv_cache_layout("tpu", FULL)


def test_layers_group_by_window_full_attention_first():
    w32 = PagedAttentionSpec(num_kv_heads=2, head_dim=8, sliding_window=32)
    groups = kv_cache_groups([WINDOW, FULL, w32, WIDE, WINDOW])
    assert groups == [KVCacheGroup(None, (1, 3)), KVCacheGroup(64, (0, 4)), KVCacheGroup(32, (2,))]
    assert kv_cache_groups([FULL, WIDE]) == [KVCacheGroup(None, (0, 1))]  # a dense model: one group
    assert kv_cache_groups([WINDOW, WINDOW]) == [KVCacheGroup(64, (0, 1))]


def test_blocks_one_sequence_holds_per_group():
    assert blocks_per_sequence(None, 1000, 256, 16) == 63  # every block
    # window 128 and a 256-token chunk: the chunk and the 127 keys before it, +1 for alignment
    assert blocks_per_sequence(128, 100_000, 256, 16) == -(-(127 + 256) // 16) + 1 == 25
    assert blocks_per_sequence(128, 40, 256, 16) == 3  # never more than the whole sequence


def test_memory_split_follows_the_needs_at_max_model_len():
    # 2 groups of equal bytes per block; the window needs 25 blocks a sequence, full attention 6250
    per_block, needs, nulls = [1000, 1000], [6250, 25], [0, 1]
    budget = 10**9
    full, window = split_kv_blocks(budget, per_block, needs, nulls)
    assert full * 1000 + window * 1000 <= budget
    seqs = (budget - 1000) / (1000 * (6250 + 25))
    assert full == int(seqs * 6250) and window == int(seqs * 25) + 1
    # against all-full accounting (every layer keeps every block: budget // 2000 blocks of both)
    assert full > 1.9 * (budget // 2000)
    assert split_kv_blocks(12345, [100], [7], [0]) == [123]  # one group: as before groups existed
    assert split_kv_blocks(12345, [100], [7], [1]) == [123]
    assert scale_kv_blocks(1000, [250, 10], [0, 1]) == [1000, 41]
    assert scale_kv_blocks(64, [8], [0]) == [64]


def test_groups_get_their_own_block_counts():
    caches = allocate_kv_cache([FULL, WINDOW, FULL], [9, 3, 9], 4, torch.float32, "cpu", layout_of=lambda s: "NHD")
    assert [k.shape[0] for k, _ in caches] == [9, 3, 9]
    assert caches[0][0].untyped_storage().data_ptr() == caches[2][0].untyped_storage().data_ptr()
