"""The AITER wrappers against a stand-in `aiter` (keyword-only, real argument names). This checks
argument names, layouts and results on CPU only: the AITER path is untested on AMD hardware."""

import sys

import fake_aiter
import pytest
import torch
from triton_kernel_cases import ATTN_CASES, WINDOW_CASES, attention_reference, make_batch, random_sinks

from atomc.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from atomc.kernels import registry
from tests.passes.pass_helpers import assert_same


@pytest.fixture
def aiter_ops(monkeypatch):
    fake_aiter.install(monkeypatch)
    # through the registry, as the lowering loads them: it defines torch.ops.atomc_aiter.* and sets
    # the attention's fallback to ROCm's next backend
    registry.lookup("attention", "aiter")
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


CASES = {**{k: (*v, 0) for k, v in ATTN_CASES.items()}, **WINDOW_CASES}


def run_paged(op, case, dtype=torch.float16, page=128, seed=0, sinks=None):
    """(op's output, the reference's) on one batch already in the cache; padding rows stay NaN."""
    q_lens, seq_lens, window = CASES[case]
    q, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, 4, 2, 16, dtype, "cpu", page=page, seed=seed)
    k, v = torch.zeros(q.shape[0], 2, 16, dtype=dtype), torch.zeros(q.shape[0], 2, 16, dtype=dtype)
    out = torch.full_like(q, float("nan"))
    fake_aiter.CALLS.clear()
    with set_forward_context(ForwardContext(meta, [(k_cache, v_cache)])):
        op(q, k, v, out, 0, 0.25, window, *(() if sinks is None else (sinks,)))
    ref = attention_reference(q, k_cache, v_cache, meta, 0.25, window, sinks)
    t = meta.query_start_loc_host[-1]
    assert out[t:].isnan().all()
    return out[:t], ref[:t]


@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_on_aiter(aiter_ops, case):
    # decode batches go to paged_attention_v1, the rest to flash_attn_varlen_func over 128-token pages
    out, ref = run_paged(aiter_ops.paged_attention, case)
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
    decode = max(CASES[case][0]) == 1
    assert fake_aiter.CALLS == ["paged_attention_v1" if decode else "flash_attn_varlen_func"]


def test_aiter_window_arguments(aiter_ops, monkeypatch):
    """What AITER is told: sliding_window=W for paged_attention_v1 (left out for full attention: older
    releases lack it), window_size=(W - 1, 0, 0) and causal for flash_attn_varlen_func."""
    seen = {}
    for name in ("paged_attention_v1", "flash_attn_varlen_func"):
        real = getattr(sys.modules["aiter"], name)

        def record(_real=real, _name=name, **kw):
            seen.setdefault(_name, []).append(kw)
            return _real(**kw)

        monkeypatch.setattr(sys.modules["aiter"], name, record)
    for case in ("decode", "decode_w24", "mixed", "mixed_w70"):
        run_paged(aiter_ops.paged_attention, case)
    pa, fa = seen["paged_attention_v1"], seen["flash_attn_varlen_func"]
    assert "sliding_window" not in pa[0] and pa[1]["sliding_window"] == 24
    assert [c["window_size"] for c in fa] == [(-1, -1, 0), (69, 0, 0)] and all(c["causal"] for c in fa)
    assert fa[0]["max_seqlen_q"] == 20 and fa[0]["cu_seqlens_k"].tolist() == [0, 37, 46, 146, 198]


@pytest.mark.parametrize("case,page,dtype", [("mixed_w70", 16, torch.float16), ("decode_w24", 128, torch.float32)])
def test_paged_attention_falls_back_where_aiter_cannot(aiter_ops, monkeypatch, case, page, dtype):
    # prefill over pages smaller than CK's 128, or fp32: ROCm's next backend (here the reference)
    monkeypatch.setattr(registry, "backend_available", lambda backend: backend != "triton")
    out, ref = run_paged(aiter_ops.paged_attention, case, dtype=dtype, page=page)
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
    assert fake_aiter.CALLS == []


@pytest.mark.parametrize("case", ["decode", "mixed_w70"])
def test_layers_with_sinks_run_the_next_backend(aiter_ops, monkeypatch, case):
    # AITER's entries are not given attention sinks: such a layer runs ROCm's next backend (here
    # the reference), even where AITER would take the batch, and gets the sinks' answer
    monkeypatch.setattr(registry, "backend_available", lambda backend: backend != "triton")
    sinks = random_sinks(4)
    out, ref = run_paged(aiter_ops.paged_attention, case, sinks=sinks)
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
    assert fake_aiter.CALLS == []
    plain, _ = run_paged(aiter_ops.paged_attention, case)
    assert fake_aiter.CALLS != [] and not torch.allclose(plain.float(), out.float(), atol=1e-2)


def test_attention_writes_the_cache_then_attends(aiter_ops):
    """atomc_aiter.attention on a chunked prefill: reshape_and_cache_flash writes this step's K/V, and the
    attention reads them with the cached prefix, as atomc.attention does."""
    g = torch.Generator().manual_seed(4)
    q_lens, seq_lens = [5, 1], [140, 9]
    q, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, 4, 2, 16, torch.float16, "cpu", page=128, pad_tokens=0)
    k, v = (torch.randn(6, 2, 16, generator=g).half() for _ in range(2))
    outs, caches = [], []
    for op in (aiter_ops.attention, torch.ops.atomc.attention):
        kc, vc, out = k_cache.clone(), v_cache.clone(), torch.empty_like(q)
        with set_forward_context(ForwardContext(meta, [(kc, vc)])):
            op(q, k, v, out, 0, 0.25, 50)
        outs.append(out)
        caches.append((kc, vc))
    assert_same(caches[0], caches[1])
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=2e-3, rtol=2e-3)
    assert "reshape_and_cache_flash" in fake_aiter.CALLS and "flash_attn_varlen_func" in fake_aiter.CALLS


def test_qk_norm_rope_and_write_kv(aiter_ops):
    # AITER rmsnorm over (token, head) rows, then RoPE, then the NHD cache write
    g = torch.Generator().manual_seed(8)
    d, table = 16, torch.randn(64, 16, generator=g)
    positions = torch.tensor([3, 0, 9, 4])
    q, k, v = (torch.randn(4, h, d, generator=g) for h in (4, 2, 2))
    wq, wk = 1 + 0.3 * torch.randn(d, generator=g), 1 + 0.3 * torch.randn(d, generator=g)
    meta = AttentionMetadata(torch.tensor([5, 0, -1, 11]), torch.tensor([0, 4]), torch.tensor([4]),
                             torch.zeros(1, 3, dtype=torch.int32))  # fmt: skip
    results, caches = [], []
    for op in (aiter_ops.qk_norm_rope_and_write_kv, torch.ops.atomc.qk_norm_rope_and_write_kv):
        cache = (torch.zeros(3, 4, 2, d), torch.zeros(3, 4, 2, d))
        with set_forward_context(ForwardContext(meta, [cache])):
            results.append(op(positions, 3 * q, k, v, wq, 1e-6, wk, 1e-5, table, 0))
        caches.append(cache)
    assert_same(results[0], results[1], atol=1e-5, rtol=1e-5)
    assert_same(caches[0], caches[1], atol=1e-5, rtol=1e-5)
    assert fake_aiter.CALLS.count("rmsnorm2d_fwd") == 2 and "reshape_and_cache_flash" in fake_aiter.CALLS
