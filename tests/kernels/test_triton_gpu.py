"""Triton kernels vs torch references on CUDA in bf16 (plus Llama-like shapes and CUDA-graph capture)."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

from triton_kernel_cases import (  # noqa: E402
    ATTN_CASES,
    WINDOW_CASES,
    attention_reference,
    cos_sin_cache,
    make_batch,
    random_sinks,
    rel_err,
    rms_norm_reference,
    rope_reference,
    silu_and_mul_reference,
)

from atomc.ops.attention import write_kv_cache as write_kv_cache_reference  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
REL = 1e-2


def kernels():
    import atomc.kernels.triton as kt

    return kt


def run_attention(q_lens, seq_lens, hq, hkv, d, num_segments=None, sliding_window=0, sinks=None, **kw):
    q, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, hq, hkv, d, BF16, DEV)
    scale = d**-0.5
    out = torch.full_like(q, float("nan"))
    kernels().paged_attention(
        q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
        meta.max_query_len, meta.max_seq_len, meta.num_seqs, num_segments=num_segments,
        sliding_window=sliding_window, sinks=sinks, **kw,
    )  # fmt: skip
    ref = attention_reference(q, k_cache, v_cache, meta, scale, sliding_window, sinks)
    t = meta.query_start_loc_host[-1]
    assert not out[:t].isnan().any()
    assert out[t:].isnan().all()
    assert rel_err(out[:t], ref[:t]) < REL


@pytest.mark.parametrize("segments", [1, 8])
@pytest.mark.parametrize("case", list(ATTN_CASES))
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 32), (32, 8, 128), (12, 2, 64)])
def test_paged_attention(case, hq, hkv, d, segments):
    run_attention(*ATTN_CASES[case], hq, hkv, d, num_segments=segments)


@pytest.mark.parametrize("segments", [1, 8, None])
@pytest.mark.parametrize("case", list(WINDOW_CASES))
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 32), (32, 8, 128)])
def test_paged_attention_sliding_window(case, hq, hkv, d, segments):
    q_lens, seq_lens, window = WINDOW_CASES[case]
    run_attention(q_lens, seq_lens, hq, hkv, d, num_segments=segments, sliding_window=window)


@pytest.mark.parametrize("segments", [1, 8, None])
@pytest.mark.parametrize("case", ["mixed", "decode", "prefill_w8", "decode_w24", "mixed_w70"])
def test_paged_attention_sinks(case, segments):
    # GPT-OSS-20B's heads (64 q, 8 kv, head_dim 64) with bf16 sinks, with and without a window
    q_lens, seq_lens, window = WINDOW_CASES[case] if case in WINDOW_CASES else (*ATTN_CASES[case], 0)
    sinks = random_sinks(64, DEV).to(BF16)
    run_attention(q_lens, seq_lens, 64, 8, 64, num_segments=segments, sliding_window=window, sinks=sinks)


def test_paged_attention_sinks_gpt_oss_decode():
    # GPT-OSS's 128-token window, decode far past it, beside full layers' long contexts
    sinks = random_sinks(64, DEV)
    for window in (128, 0):
        run_attention([1] * 8, [3000 + 13 * i for i in range(8)], 64, 8, 64, sliding_window=window, sinks=sinks)


def test_paged_attention_sliding_window_mistral_decode():
    # Mistral-7B's 4,096-token window, decode at 3x the window
    run_attention([1] * 8, [12000 + 13 * i for i in range(8)], 32, 8, 128, sliding_window=4096)


@pytest.mark.parametrize("ctx", [1, 100, 1000, 5000])
@pytest.mark.parametrize("bs", [1, 3, 40])
def test_paged_attention_decode_llama(bs, ctx):
    run_attention([1] * bs, [ctx + 7 * i for i in range(bs)], 32, 8, 128)


@pytest.mark.parametrize("ctx", [100, 1000, 5000])
@pytest.mark.parametrize("bs", [1, 3])
def test_paged_attention_decode_merged_in_the_kernel(bs, ctx):
    """Split-KV merged by each q block's last segment program (the arrival counter), twice in a row:
    the first launch must leave the counters at zero for the second."""
    for _ in range(2):
        run_attention([1] * bs, [ctx + 7 * i for i in range(bs)], 32, 8, 128, num_segments=16, merge_in_kernel=True)


def test_paged_attention_long_prefill():
    run_attention([700, 1, 300], [1500, 900, 300], 32, 8, 128)


def test_paged_attention_cuda_graph():
    # decode captured once with an upper bound for max_seq_len, replayed on longer contexts
    kt = kernels()
    bs, bound = 4, 4096
    q, k_cache, v_cache, meta = make_batch([1] * bs, [50, 300, 1200, 3000], 32, 8, 128, BF16, DEV, pad_tokens=0)
    out = torch.empty_like(q)

    def step():
        kt.paged_attention(
            q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.1,
            1, bound, bs,
        )  # fmt: skip

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in ([50, 300, 1200, 3000], [51, 301, 1201, 3001]):
        meta.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        meta.seq_lens_host = lens
        q.normal_()
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, attention_reference(q, k_cache, v_cache, meta, 0.1)) < REL


def test_write_kv_cache():
    k, v = (torch.randn(64, 8, 128, device=DEV, dtype=BF16) for _ in range(2))
    slots = torch.randperm(256, device=DEV)[:64]
    slots[::7] = -1
    caches = [torch.full((16, 16, 8, 128), float("nan"), device=DEV, dtype=BF16) for _ in range(4)]
    kernels().write_kv_cache(k, v, caches[0], caches[1], slots)
    write_kv_cache_reference(k, v, caches[2], caches[3], slots)
    torch.testing.assert_close(caches[0], caches[2], equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(caches[1], caches[3], equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("t", [1, 64, 4096])
def test_rms_norm(t):
    x, r = (torch.randn(t, 4096, device=DEV, dtype=BF16) for _ in range(2))
    w = (1 + 0.1 * torch.randn(4096, device=DEV)).to(BF16)
    assert rel_err(kernels().rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5)) < REL
    out, res = kernels().fused_add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(res, x + r, atol=0, rtol=0)
    assert rel_err(out, rms_norm_reference(x + r, w, 1e-5)) < REL


@pytest.mark.parametrize("t", [1, 300])
def test_rope_and_write_kv(t):
    q = torch.randn(t, 32, 128, device=DEV, dtype=BF16)
    k, v = (torch.randn(t, 8, 128, device=DEV, dtype=BF16) for _ in range(2))
    positions = torch.randint(0, 8192, (t,), device=DEV)
    cs = cos_sin_cache(8192, 128, DEV)
    q_ref, k_ref = rope_reference(positions, q, cs), rope_reference(positions, k, cs)
    slots = torch.randperm(2048, device=DEV)[:t]
    slots[::5] = -1
    kc, vc = (torch.full((128, 16, 8, 128), float("nan"), device=DEV, dtype=BF16) for _ in range(2))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv_cache_reference(k_ref, v, kc_ref, vc_ref, slots)
    kernels().rope_and_write_kv(positions, q, k, v, cs, kc, vc, slots)
    assert rel_err(q, q_ref) < REL and rel_err(k, k_ref) < REL
    assert torch.equal(kc.isnan(), kc_ref.isnan())
    assert rel_err(kc.nan_to_num(), kc_ref.nan_to_num()) < REL
    torch.testing.assert_close(vc, vc_ref, equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("t", [1, 64])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_and_write_kv_from_qkv_slices_into_new_tensors(t, qk_norm):
    """What the atomc_triton RoPE ops run (Llama-3.1-8B shapes): strided q/k slices of one qkv
    output rotated into new tensors, bit for bit what rotating contiguous copies in place gives."""
    qkv = torch.randn(t, 48 * 128, device=DEV, dtype=BF16)
    q, k, v = (x.view(t, -1, 128) for x in qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1))
    w = 1 + 0.5 * torch.randn(128, device=DEV, dtype=BF16)
    norm = (w, 1e-6, w, 1e-6) if qk_norm else None
    positions, cs = torch.randint(0, 8192, (t,), device=DEV), cos_sin_cache(8192, 128, DEV)
    slots = torch.randperm(2048, device=DEV)[:t]
    kc, vc, kc_ref, vc_ref = (torch.zeros(128, 16, 8, 128, device=DEV, dtype=BF16) for _ in range(4))
    before = qkv.clone()
    q_ref, k_ref = kernels().rope_and_write_kv(positions, q.clone(), k.clone(), v, cs, kc_ref, vc_ref, slots, norm)
    out = torch.empty_like(q_ref), torch.empty_like(k_ref)
    kernels().rope_and_write_kv(positions, q, k, v, cs, kc, vc, slots, qk_norm=norm, out=out)
    assert torch.equal(out[0], q_ref) and torch.equal(out[1], k_ref)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref) and torch.equal(qkv, before)


@pytest.mark.parametrize("t", [1, 64, 4096])
def test_qk_norm_rope_and_write_kv(t):
    from atomc.ops.norm import rms_norm_reference

    q = 3 * torch.randn(t, 32, 128, device=DEV, dtype=BF16)
    k, v = (torch.randn(t, 8, 128, device=DEV, dtype=BF16) for _ in range(2))
    qw, kw = (1 + 0.5 * torch.randn(128, device=DEV, dtype=BF16) for _ in range(2))
    positions = torch.randint(0, 8192, (t,), device=DEV)
    cs = cos_sin_cache(8192, 128, DEV)
    q_ref = rope_reference(positions, rms_norm_reference(q, qw, 1e-6), cs)
    k_ref = rope_reference(positions, rms_norm_reference(k, kw, 1e-6), cs)
    slots = torch.randperm(2048, device=DEV)[:t]
    kc, vc = (torch.full((128, 16, 8, 128), float("nan"), device=DEV, dtype=BF16) for _ in range(2))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv_cache_reference(k_ref, v, kc_ref, vc_ref, slots)
    kernels().rope_and_write_kv(positions, q, k, v, cs, kc, vc, slots, qk_norm=(qw, 1e-6, kw, 1e-6))
    assert rel_err(q, q_ref) < REL and rel_err(k, k_ref) < REL
    assert rel_err(kc.nan_to_num(), kc_ref.nan_to_num()) < REL
    torch.testing.assert_close(vc, vc_ref, equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("t", [1, 64, 4096])
def test_silu_and_mul(t):
    x = torch.randn(t, 2 * 14336, device=DEV, dtype=BF16)
    assert rel_err(kernels().silu_and_mul(x), silu_and_mul_reference(x)) < REL


@pytest.mark.parametrize("m,n,k,split_k", [(1, 6144, 4096, 1), (8, 4096, 14336, 4), (16, 28672, 4096, 2)])
def test_gemv(m, n, k, split_k):
    from atomc.kernels.triton.gemv import gemv

    x = torch.randn(m, k, device=DEV, dtype=BF16)
    w = torch.randn(n, k, device=DEV, dtype=BF16) / k**0.5
    b = torch.randn(n, device=DEV, dtype=BF16)
    assert rel_err(gemv(x, w, b, split_k=split_k), torch.nn.functional.linear(x, w, b)) < REL


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (4096, 14336), (28672, 4096), (151936, 4096)])
def test_linear_one_row_on_8b_shapes(n, k):
    from atomc.kernels.triton.gemv import linear

    x = torch.randn(1, k, device=DEV, dtype=BF16)
    w = torch.randn(n, k, device=DEV, dtype=BF16) / k**0.5
    b = torch.randn(n, device=DEV, dtype=BF16)
    assert rel_err(linear(x, w, b), torch.nn.functional.linear(x, w, b)) < REL
    assert rel_err(linear(x, w), torch.nn.functional.linear(x, w)) < REL
