"""KV-cache sizing and allocation from per-layer specs (runtime/kv_cache.py), the page layout from
the attention backend (kernels/registry.py)."""

from __future__ import annotations

import pytest
import torch

from atomc.kernels.registry import kv_cache_layout
from atomc.kv_spec import PagedAttentionSpec
from atomc.runtime.kv_cache import allocate_kv_cache, bytes_per_block

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
