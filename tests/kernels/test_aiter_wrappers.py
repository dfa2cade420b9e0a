"""The AITER wrappers against a stand-in `aiter` (keyword-only, real argument names). This checks
argument names, layouts and results on CPU only: the AITER path is untested on AMD hardware."""

import sys

import fake_aiter
import pytest
import torch
from tests.passes.pass_helpers import assert_same

from atomc.forward_context import AttentionMetadata, ForwardContext, set_forward_context


@pytest.fixture
def aiter_ops(monkeypatch):
    monkeypatch.setitem(sys.modules, "aiter", fake_aiter.module())
    fake_aiter.CALLS.clear()
    from atomc.kernels.aiter import ops  # noqa: F401  (defines torch.ops.atomc_aiter.*)

    return torch.ops.atomc_aiter


def test_norms_and_activation(aiter_ops):
    x, r, w = torch.randn(2, 5, 32), torch.randn(2, 5, 32), torch.randn(32)
    assert_same(aiter_ops.rms_norm(x, w, 1e-6), torch.ops.atomc.rms_norm(x, w, 1e-6))
    assert_same(aiter_ops.fused_add_rms_norm(x, r, w, 1e-6), torch.ops.atomc.fused_add_rms_norm(x, r, w, 1e-6))
    y = torch.randn(5, 48)
    assert_same(aiter_ops.silu_and_mul(y), torch.ops.atomc.silu_and_mul(y))
    assert fake_aiter.CALLS == ["rmsnorm2d_fwd", "rmsnorm2d_fwd_with_add", "silu_and_mul"]


def test_rope_and_cache_write(aiter_ops):
    d, table = 16, torch.randn(64, 16)
    positions = torch.tensor([3, 0, 9, 4])
    q, k, v = torch.randn(4, 4, d), torch.randn(4, 2, d), torch.randn(4, 2, d)
    ref = torch.ops.atomc.rope(positions, q, k, table)
    assert_same(aiter_ops.rope(positions, q, k, table), ref, atol=1e-6, rtol=1e-6)
    caches = [(torch.zeros(3, 4, 2, d), torch.zeros(3, 4, 2, d)) for _ in range(2)]
    slots = torch.tensor([5, 0, -1, 11])
    meta = AttentionMetadata(slots, torch.tensor([0, 4]), torch.tensor([4]), torch.zeros(1, 3, dtype=torch.int32))
    results = []
    for op, cache in ((aiter_ops.rope_and_write_kv, caches[0]), (torch.ops.atomc.rope_and_write_kv, caches[1])):
        with set_forward_context(ForwardContext(meta, [cache])):
            results.append(op(positions, q, k, v, table, 0))
    assert_same(results[0], results[1], atol=1e-6, rtol=1e-6)
    assert_same(caches[0], caches[1], atol=1e-6, rtol=1e-6)
    assert "reshape_and_cache_flash" in fake_aiter.CALLS
