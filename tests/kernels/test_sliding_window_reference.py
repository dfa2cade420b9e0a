"""The torch reference's sliding window (`atomc.ops.attention`) against a dense masked softmax built
position by position: prefill, chunked prefill over a cached prefix longer than the window, decode
far past the window, mixed batches, and the no-cache path."""

import pytest
import torch
from triton_kernel_cases import WINDOW_CASES, dense_window_attention, make_batch, random_sinks, release_behind_window

from atomc.forward_context import ForwardContext, set_forward_context
from atomc.ops.attention import causal_attention, paged_attention_reference


@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_reference_window_matches_dense_mask(case):
    q_lens, seq_lens, window = WINDOW_CASES[case]
    q, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, 4, 2, 16, torch.float32, "cpu", seed=3)
    out = torch.zeros_like(q)
    paged_attention_reference(q, k_cache, v_cache, out, meta, 0.25, window)
    want = dense_window_attention(q, k_cache, v_cache, meta, 0.25, window)
    t = meta.query_start_loc_host[-1]
    torch.testing.assert_close(out[:t].double(), want[:t], atol=1e-5, rtol=1e-5)
    # the window changes the answer wherever a query has keys outside it
    full = torch.zeros_like(q)
    paged_attention_reference(q, k_cache, v_cache, full, meta, 0.25)
    assert not torch.allclose(full[:t], out[:t], atol=1e-3)


def test_window_wider_than_every_context_is_full_attention():
    q, k_cache, v_cache, meta = make_batch([1, 9, 1, 20], [37, 9, 100, 52], 4, 2, 16, torch.float32, "cpu")
    outs = []
    for window in (0, 100, 4096):
        out = torch.zeros_like(q)
        paged_attention_reference(q, k_cache, v_cache, out, meta, 0.25, window)
        outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    torch.testing.assert_close(outs[0], outs[2], atol=0, rtol=0)


def test_no_cache_path_and_ops_take_the_window():
    # one causal sequence without a KV cache (plain forward, tracing): same dense oracle
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(30, h, 16, generator=g) for h in (4, 2, 2))
    got = causal_attention(q, k, v, 0.25, sliding_window=7)
    pos = torch.arange(30)
    mask = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < 7)
    kk, vv = k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * 0.25
    want = torch.einsum("hqk,khd->qhd", s.masked_fill(~mask, float("-inf")).softmax(-1), vv)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    for op in (torch.ops.atomc.attention, torch.ops.atomc.paged_attention):
        out = torch.empty_like(q)
        with set_forward_context(ForwardContext()):
            op(q, k, v, out, 0, 0.25, 7)
        torch.testing.assert_close(out, got, atol=0, rtol=0)
        op(q, k, v, out, 0, 0.25)  # the schema default: full attention
        torch.testing.assert_close(out, causal_attention(q, k, v, 0.25), atol=0, rtol=0)


@pytest.mark.parametrize("case", ["prefill_w8", "chunked_prefill_w20", "decode_w24", "mixed_w70", "full"])
def test_reference_sinks_match_dense_oracle(case):
    """Attention sinks (GPT-OSS) in the reference, with and without a window, against the fp64 oracle
    that adds exp(sink) to each softmax denominator; and the sinks change the answer."""
    q_lens, seq_lens, window = WINDOW_CASES[case] if case != "full" else ([1, 9, 1, 20], [37, 9, 100, 52], 0)
    q, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, 4, 2, 16, torch.float32, "cpu", seed=3)
    sinks = random_sinks(4)
    out = torch.zeros_like(q)
    paged_attention_reference(q, k_cache, v_cache, out, meta, 0.25, window, sinks)
    want = dense_window_attention(q, k_cache, v_cache, meta, 0.25, window, sinks)
    t = meta.query_start_loc_host[-1]
    torch.testing.assert_close(out[:t].double(), want[:t], atol=1e-5, rtol=1e-5)
    plain = torch.zeros_like(q)
    paged_attention_reference(q, k_cache, v_cache, plain, meta, 0.25, window)
    assert not torch.allclose(plain[:t], out[:t], atol=1e-2)


def test_no_cache_path_and_ops_take_the_sinks():
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(12, h, 16, generator=g) for h in (4, 2, 2))
    sinks = random_sinks(4)
    got = causal_attention(q, k, v, 0.25, sliding_window=5, sinks=sinks)
    # the no-cache path is one sequence: the paged oracle over a cache holding exactly these keys
    meta_q, k_cache, v_cache, meta = make_batch([12], [12], 4, 2, 16, torch.float32, "cpu")
    slots = meta.slot_mapping[:12]
    k_cache.view(-1, 2, 16)[slots], v_cache.view(-1, 2, 16)[slots] = k, v
    want = dense_window_attention(q, k_cache, v_cache, meta, 0.25, 5, sinks)
    torch.testing.assert_close(got.double(), want[:12], atol=1e-5, rtol=1e-5)
    for op in (torch.ops.atomc.attention, torch.ops.atomc.paged_attention):
        out = torch.empty_like(q)
        with set_forward_context(ForwardContext()):
            op(q, k, v, out, 0, 0.25, 5, sinks)
        torch.testing.assert_close(out, got, atol=0, rtol=0)


@pytest.mark.parametrize("case", list(WINDOW_CASES))
def test_reference_never_reads_blocks_released_behind_the_window(case):
    # a windowed KV group frees the blocks before the window; their entries hold a placeholder. The
    # reference must not read them: poisoned with NaN, the output is still the dense oracle's
    q_lens, seq_lens, window = WINDOW_CASES[case]
    q, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, 4, 2, 16, torch.float32, "cpu", seed=3)
    want = dense_window_attention(q, k_cache, v_cache, meta, 0.25, window)
    released = release_behind_window(meta, k_cache, v_cache, window, float("nan"))
    if released is None:
        pytest.skip("every query's window starts in its first block")
    out = torch.zeros_like(q)
    paged_attention_reference(q, k_cache, v_cache, out, released, 0.25, window)
    t = meta.query_start_loc_host[-1]
    torch.testing.assert_close(out[:t].double(), want[:t], atol=1e-5, rtol=1e-5)
