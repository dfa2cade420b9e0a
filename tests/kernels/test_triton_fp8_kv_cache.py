"""FP8 (e4m3) KV cache: the torch reference's write and read, and the Triton kernels that write the
pages (the plain write, the fused RoPE + write) and read them (paged attention: prefill, chunked
prefill, decode, mixed; 2D and split-KV), on CPU through the Triton interpreter, fp32 and fp16 queries.

Rounding: the interpreter's own fp32 -> e4m3 cast mis-rounds where rounding carries into the
exponent, so under TRITON_INTERPRET=1 the write kernels round to the e4m3 grid in fp32 arithmetic
first (`fp8_quant.ROUND_IN_FP32`, checked against torch's cast in test_triton_fp8.py). The stored
bytes are then compared exactly with the reference's: both divide the same fp32 value by the same
fp32 scale (one correctly rounded IEEE op) and round to nearest even. The fused RoPE write is
compared against the reference quantisation of the kernel's own rotated k (rotation rounding is
tested in test_triton_kernels.py). Attention reads the same stored bytes as the reference, so the
kernel-vs-reference tolerances are the bf16 kernel's (TOL); against attention over the unquantised
K/V the error is e4m3's (3 mantissa bits: about 2^-4 relative per value), bounded below at 6%.
"""

import pytest
import torch
from triton_interpreter import use_interpreter

use_interpreter()  # before the first triton import; the GPU file covers CUDA

triton = pytest.importorskip("triton")
from triton_kernel_cases import (  # noqa: E402
    ATTN_CASES,
    WINDOW_CASES,
    attention_reference,
    cos_sin_cache,
    make_batch,
    random_sinks,
    rel_err,
)

import atomc.ops  # noqa: E402, F401
from atomc.forward_context import ForwardContext, set_forward_context  # noqa: E402
from atomc.kernels import registry  # noqa: E402
from atomc.kernels.triton import paged_attention, rope, rope_and_write_kv, write_kv_cache  # noqa: E402
from atomc.kernels.triton.fp8_quant import ROUND_IN_FP32  # noqa: E402
from atomc.ops.attention import FP8_MAX, dequantize_kv, paged_attention_reference, quantize_kv  # noqa: E402
from atomc.ops.attention import write_kv_cache as write_reference  # noqa: E402

FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def scales(k=0.03, v=0.025):
    return torch.tensor([k]), torch.tensor([v])


def fp8_batch(case, dtype, hq=4, hkv=2, d=32, kv_scales=None, seed=0):
    """make_batch's inputs with FP8 pages: the values it drew (times 2: |x| < 10, so x / scale stays
    inside e4m3's ±448 with the default scales) quantised with `kv_scales`; also the unquantised pages."""
    kv_scales = kv_scales or scales()
    q_lens, seq_lens = WINDOW_CASES[case][:2] if case in WINDOW_CASES else ATTN_CASES[case]
    q, k_vals, v_vals, meta = make_batch(q_lens, seq_lens, hq, hkv, d, torch.float32, "cpu", seed=seed)
    k_vals, v_vals = k_vals * 2, v_vals * 2
    k_cache = quantize_kv(k_vals, FP8, kv_scales[0])
    v_cache = quantize_kv(v_vals, FP8, kv_scales[1])
    return q.to(dtype), k_cache, v_cache, meta, kv_scales, (k_vals, v_vals)


def test_reference_quantize_saturates_and_rounds_to_nearest():
    x = torch.tensor([0.0, 1.0, -3.3, 1e6, -1e6, 0.0013])
    q = quantize_kv(x, FP8, torch.tensor([0.5]))
    assert q.dtype == FP8
    assert q.float().tolist() == [0.0, 2.0, -6.5, FP8_MAX, -FP8_MAX, 2**-9]  # 0.0026 = 1.33 subnormal steps
    assert torch.equal(dequantize_kv(q, torch.tensor([0.5])), q.float() * 0.5)
    assert quantize_kv(x, torch.float16, None).dtype == torch.float16  # not FP8: a plain cast


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache_fp8_matches_reference(dtype):
    g = torch.Generator().manual_seed(1)
    k = (torch.randn(6, 2, 16, generator=g) * 3).to(dtype)
    v = (torch.randn(6, 2, 16, generator=g) * 3).to(dtype)
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 124.3 * 0.03, 0.0])  # saturation both ways; a carry into the exponent
    slots = torch.tensor([3, 17, -1, 40, 0, -1])
    caches = [torch.zeros(4, 16, 2, 16, dtype=FP8) for _ in range(4)]
    kv_scales = scales()
    write_kv_cache(k, v, caches[0], caches[1], slots, kv_scales)
    write_reference(k, v, caches[2], caches[3], slots, kv_scales)
    assert ROUND_IN_FP32  # the interpreter's write rounds in fp32 arithmetic (module docstring)
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert caches[0].float().abs().max() == FP8_MAX
    # the quantisation itself: dequantised pages are k within e4m3's relative step
    rows = caches[2].view(-1, 2, 16)[slots[slots >= 0]].float() * kv_scales[0]
    want = k[slots >= 0].float().clamp(-FP8_MAX * 0.03, FP8_MAX * 0.03)
    assert ((rows - want).abs() <= want.abs() * 2**-4 + 2**-9 * 0.03).all()


def test_fp8_pages_without_scales_are_refused():
    k = torch.randn(2, 2, 16)
    cache = torch.zeros(4, 16, 2, 16, dtype=FP8)
    with pytest.raises(ValueError, match="k_scale, v_scale"):
        write_kv_cache(k, k, cache, cache.clone(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="no k/v scales"):
        with set_forward_context(ForwardContext(fp8_batch("decode", torch.float32)[3], [(cache, cache)])):
            torch.ops.atomc.attention(k, k, k, torch.empty_like(k), 0, 0.25)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_and_write_kv_fp8(dtype, qk_norm):
    """The fused write stores the reference quantisation of the kernel's own rotated k, and of v."""
    g = torch.Generator().manual_seed(4)
    t, hq, hkv, d = 5, 4, 2, 32
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = (torch.randn(t, hkv, d, generator=g) * 4).to(dtype)
    v = (torch.randn(t, hkv, d, generator=g) * 4).to(dtype)
    positions = torch.tensor([0, 3, 7, 1, 30])
    slots = torch.tensor([5, -1, 33, 2, 60])
    cs = cos_sin_cache(64, d, "cpu")
    norm = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype), 1e-6
    qk = (*norm, *norm) if qk_norm else None
    k_cache, v_cache = torch.zeros(4, 16, hkv, d, dtype=FP8), torch.zeros(4, 16, hkv, d, dtype=FP8)
    kv_scales = scales()
    q_rot, k_rot = rope_and_write_kv(
        positions, q.clone(), k.clone(), v, cs, k_cache, v_cache, slots, qk_norm=qk, kv_scales=kv_scales
    )
    # the same rotation through the rotate-only launch (same kernel body)
    q_only, k_only = rope(positions, q.clone(), k.clone(), cs, qk_norm=qk)
    assert torch.equal(k_rot, k_only) and torch.equal(q_rot, q_only)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    write_reference(k_rot, v, want_k, want_v, slots, kv_scales)
    assert torch.equal(k_cache.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8))


def run_fp8_attention(case, dtype, num_segments, sinks=None, f16_dots=None, **kw):
    q, k_cache, v_cache, meta, kv_scales, (k_vals, v_vals) = fp8_batch(case, dtype, **kw)
    window = WINDOW_CASES[case][2] if case in WINDOW_CASES else 0
    scale = q.shape[-1] ** -0.5
    out = torch.full_like(q, float("nan"))
    paged_attention(
        q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
        meta.max_query_len, meta.max_seq_len, meta.num_seqs, num_segments=num_segments, kv_scales=kv_scales,
        sliding_window=window, sinks=sinks, tile_n=16 if window else None, fp8_f16_dots=f16_dots,
    )  # fmt: skip
    t = meta.query_start_loc_host[-1]
    assert not out[:t].isnan().any() and out[t:].isnan().all()
    ref = torch.zeros_like(q, dtype=torch.float32)
    paged_attention_reference(q.float(), k_cache, v_cache, ref, meta, scale, window, sinks, kv_scales)
    tol = TOL[torch.float16 if f16_dots else dtype]  # fp16 dots: fp16's rounding of q and P
    assert rel_err(out[:t], ref[:t]) < tol
    torch.testing.assert_close(out[:t].float(), ref[:t], atol=tol * 10, rtol=tol * 10)
    # the reference's FP8 read is attention over the dequantised pages
    k_deq, v_deq = dequantize_kv(k_cache, kv_scales[0]), dequantize_kv(v_cache, kv_scales[1])
    dense = attention_reference(q, k_deq, v_deq, meta, scale, window, sinks)
    torch.testing.assert_close(ref[:t], dense[:t], atol=1e-5, rtol=1e-5)
    # and e4m3's error against attention over the unquantised values
    exact = attention_reference(q, k_vals, v_vals, meta, scale, window, sinks)
    err = rel_err(out[:t], exact[:t])
    assert 1e-4 < err < 0.06, f"FP8 KV error {err:.3g} against the unquantised K/V"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(ATTN_CASES))
def test_paged_attention_fp8_2d(case, dtype):
    run_fp8_attention(case, dtype, num_segments=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["decode", "mixed"])
def test_paged_attention_fp8_split_kv(case, dtype):
    run_fp8_attention(case, dtype, num_segments=4, hkv=1, d=16)


@pytest.mark.parametrize("num_segments", [1, 4])
@pytest.mark.parametrize("case", ["mixed_w70", "decode_w24"])
def test_paged_attention_fp8_with_window_and_sinks(case, num_segments):
    """FP8 pages under the other constexpr paths (a sliding window; GPT-OSS's sinks), fp16 queries."""
    run_fp8_attention(case, torch.float16, num_segments, d=16)
    run_fp8_attention(case, torch.float16, num_segments, d=16, sinks=random_sinks(4))


@pytest.mark.parametrize("num_segments", [1, 4])
@pytest.mark.parametrize("case", ["decode", "mixed"])
def test_paged_attention_fp8_f16_dots(case, num_segments):
    """The fp16 dots bf16 queries take over FP8 pages on a GPU (F16_DOTS), forced here for fp32
    queries (the interpreter cannot run bf16): q and P rounded to fp16, fp16's tolerance."""
    run_fp8_attention(case, torch.float32, num_segments, f16_dots=True, hkv=1, d=16)


def test_paged_attention_fp8_f16_dots_clamp_q_to_fp16():
    """A query value past fp16's range is clamped to ±65504, not turned into inf (and NaN scores)."""
    q, k_cache, v_cache, meta, kv_scales, _ = fp8_batch("decode", torch.float32, hkv=1, d=16)
    q[0, 0, 0] = 1e6
    t = meta.query_start_loc_host[-1]
    out = torch.zeros_like(q)
    paged_attention(
        q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, 1e-4,
        meta.max_query_len, meta.max_seq_len, meta.num_seqs, num_segments=1, kv_scales=kv_scales,
        fp8_f16_dots=True,
    )  # fmt: skip
    assert out[:t].isfinite().all()
    clamped = q.clone()
    clamped[0, 0, 0] = 65504.0
    ref = torch.zeros_like(q)
    paged_attention_reference(clamped, k_cache, v_cache, ref, meta, 1e-4, 0, None, kv_scales)
    assert rel_err(out[:t], ref[:t]) < TOL[torch.float16]


def test_paged_attention_fp8_scales_are_applied():
    """Other scales over the same stored bytes scale the logits (k) and the output (v) as they should:
    v_scale x 2 doubles the output; k_scale enters the softmax (a different output)."""
    q, k_cache, v_cache, meta, (ks, vs), _ = fp8_batch("mixed", torch.float32)
    t = meta.query_start_loc_host[-1]
    outs = []
    for kv_scales in ((ks, vs), (ks, vs * 2), (ks * 3, vs)):
        out = torch.zeros_like(q)
        paged_attention(
            q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.2,
            meta.max_query_len, meta.max_seq_len, meta.num_seqs, num_segments=1, kv_scales=kv_scales,
        )  # fmt: skip
        outs.append(out[:t])
    torch.testing.assert_close(outs[1], outs[0] * 2, atol=1e-5, rtol=1e-5)
    assert rel_err(outs[2], outs[0]) > 0.05


@pytest.mark.parametrize("op", ["attention", "paged_attention"])
def test_backend_ops_read_scales_from_the_forward_context(op):
    """The lowered graph's Triton op against the atomc op (torch reference), FP8 pages in both, the
    scales from the context: what each writes (attention) and what each returns."""
    q, k_cache, v_cache, meta, kv_scales, _ = fp8_batch("mixed", torch.float32)
    g = torch.Generator().manual_seed(9)
    k, v = torch.randn(q.shape[0], 2, 32, generator=g), torch.randn(q.shape[0], 2, 32, generator=g)
    outs, pages = [], []
    for fn in (registry.lookup(op, "triton"), getattr(torch.ops.atomc, op).default):
        caches = (k_cache.clone(), v_cache.clone())
        out = torch.zeros_like(q)
        with set_forward_context(ForwardContext(meta, [caches], kv_scales=[kv_scales])):
            fn(q, k, v, out, 0, 0.2)
        outs.append(out)
        pages.append(caches)
    t = meta.query_start_loc_host[-1]
    torch.testing.assert_close(outs[0][:t], outs[1][:t], atol=1e-5, rtol=1e-5)
    for a, b in zip(pages[0], pages[1], strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if op == "attention":
        assert not torch.equal(pages[0][0].view(torch.uint8), k_cache.view(torch.uint8))  # it wrote
