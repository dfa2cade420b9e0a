"""RoPE, the cache write and decode attention in one launch (`paged_attention(rope=DecodeRope(...))`),
against the two launches it replaces (the Triton RoPE + KV write, then the Triton attention over the
written cache), on CPU through the Triton interpreter, fp32 and fp16.

Both paths rotate in fp32 and round to the input's dtype, so the written pages match to the
rounding of one fp32 product; the attention output differs only in how the new key's score and
value enter the softmax (a row sum and a product in fp32 here, the tensor-core dot there)."""

import pytest
import torch
from triton_interpreter import use_interpreter

use_interpreter()  # before the first triton import; the GPU file covers CUDA

triton = pytest.importorskip("triton")
from triton_kernel_cases import cos_sin_cache, make_batch, random_sinks, rel_err  # noqa: E402

from atomc.kernels.triton import paged_attention, rope_and_write_kv  # noqa: E402
from atomc.kernels.triton.paged_attention import DecodeRope  # noqa: E402
from atomc.ops.attention import quantize_kv  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
FP8 = torch.float8_e4m3fn


def _decode_step(seq_lens, hq, hkv, d, dtype, seed=0, fp8_scales=None):
    """A decode batch (one new token a sequence, two padding rows) with this step's q, k and v before
    RoPE; the cache holds the earlier tokens (the new tokens' slots are NaN until written)."""
    q, k_cache, v_cache, meta = make_batch([1] * len(seq_lens), seq_lens, hq, hkv, d, dtype, "cpu", seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    t = q.shape[0]
    k = torch.randn(t, hkv, d, generator=g).to(dtype)
    v = torch.randn(t, hkv, d, generator=g).to(dtype)
    positions = torch.zeros(t, dtype=torch.int64)
    positions[: len(seq_lens)] = torch.tensor(seq_lens) - 1
    if fp8_scales is not None:
        pages = zip((k_cache, v_cache), fp8_scales, strict=True)
        k_cache, v_cache = (quantize_kv(x.float() * 2, FP8, s) for x, s in pages)
    else:
        slots = meta.slot_mapping[meta.slot_mapping >= 0]
        for cache in (k_cache, v_cache):
            cache.view(-1, hkv, d)[slots] = float("nan")  # the fused kernel must write them before any use
    return q, k, v, positions, k_cache, v_cache, meta


def _run(seq_lens, dtype, hq=4, hkv=2, d=32, qk_norm=False, fp8=False, window=0, sinks=False, **kw):
    scales = (torch.tensor([0.05]), torch.tensor([0.04])) if fp8 else None
    q, k, v, positions, k_cache, v_cache, meta = _decode_step(seq_lens, hq, hkv, d, dtype, fp8_scales=scales)
    cs = cos_sin_cache(max(seq_lens) + 1, d, "cpu")
    g = torch.Generator().manual_seed(7)
    norm = None
    if qk_norm:
        qw, kw_ = ((1 + 0.5 * torch.randn(d, generator=g)).to(dtype) for _ in range(2))
        norm = (qw, 1e-6, kw_, 1e-5)
        q, k = 3 * q, 0.5 * k  # norms that differ from 1
    sink_logits = random_sinks(hq) if sinks else None
    common = dict(sliding_window=window, sinks=sink_logits, kv_scales=scales, fp8_f16_dots=True if fp8 else None, **kw)
    args = (meta.query_start_loc, meta.seq_lens, meta.block_tables, d**-0.5, 1, meta.max_seq_len, meta.num_seqs)

    # two launches: RoPE + write, then attention over the written cache
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    q_rot, k_rot = torch.empty_like(q), torch.empty_like(k)
    rope_and_write_kv(
        positions, q, k, v, cs, kc_ref, vc_ref, meta.slot_mapping, qk_norm=norm, kv_scales=scales, out=(q_rot, k_rot)
    )
    ref = torch.full_like(q, float("nan"))
    paged_attention(q_rot, kc_ref, vc_ref, ref, *args, **common)

    out = torch.full_like(q, float("nan"))
    rope = DecodeRope(positions, k, v, cs, meta.slot_mapping, norm)
    paged_attention(q, k_cache, v_cache, out, *args, rope=rope, **common)

    t = len(seq_lens)
    assert not out[:t].isnan().any(), "a query row was not written"
    assert out[t:].isnan().all(), "padding rows must stay untouched"
    tol = TOL[dtype] * (4 if qk_norm else 1)
    assert rel_err(out[:t], ref[:t]) < tol
    torch.testing.assert_close(out[:t], ref[:t], atol=tol * 10, rtol=tol * 10)
    # the new keys and values are in their slots, as the RoPE kernel writes them; nothing else moved
    for got, want in ((k_cache, kc_ref), (v_cache, vc_ref)):
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, equal_nan=True)
    return out


DECODE = [1, 15, 64, 150]  # a first token (no cached key), within a page, a tile, several tiles


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("segments", [1, 4])
def test_rope_in_decode_attention(dtype, segments):
    _run(DECODE, dtype, num_segments=segments)


@pytest.mark.parametrize("merge_in_kernel", [False, True])
def test_rope_in_split_kv_decode_merged_either_way(merge_in_kernel):
    # 4 segments over 150 keys: the new key lands in the last segment's program only
    _run(DECODE, torch.float32, hkv=1, d=16, num_segments=4, merge_in_kernel=merge_in_kernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qk_norms_then_rope_in_decode_attention(dtype):
    _run(DECODE, dtype, qk_norm=True, num_segments=2)


@pytest.mark.parametrize("d", [24, 80])
def test_head_dims_below_their_tile(d):
    # BLOCK_D pads 24 to 32 and 80 to 128: the rotate-half partner of each column stays inside the head
    _run([3, 70], torch.float32, hq=2, hkv=1, d=d, qk_norm=True)


def test_rope_in_decode_attention_over_fp8_pages():
    _run(DECODE, torch.float32, fp8=True, num_segments=2)


def test_rope_in_decode_attention_with_window_and_sinks():
    _run([1, 9, 130, 40], torch.float32, window=24, sinks=True, num_segments=4)


def test_the_slot_mapping_decides_what_is_written():
    # a token whose slot is -1 (or past the mapping) attends to its new key but writes nothing
    q, k, v, positions, k_cache, v_cache, meta = _decode_step([5, 20], 2, 1, 16, torch.float32)
    meta.slot_mapping[1] = -1
    before = k_cache.clone()
    cs = cos_sin_cache(32, 16, "cpu")
    out = torch.full_like(q, float("nan"))
    paged_attention(
        q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.25, 1, meta.max_seq_len,
        meta.num_seqs, rope=DecodeRope(positions, k, v, cs, meta.slot_mapping[:1]),
    )  # fmt: skip
    assert not out[:2].isnan().any()
    changed = (k_cache != before) & ~(k_cache.isnan() & before.isnan())
    assert changed.any(dim=(1, 2, 3)).sum() == 1, "only the first token's slot is written"


def test_rope_needs_a_decode_step():
    q, k, v, positions, k_cache, v_cache, meta = _decode_step([5, 20], 2, 1, 16, torch.float32)
    with pytest.raises(AssertionError, match="decode"):
        paged_attention(
            q, k_cache, v_cache, torch.empty_like(q), meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.25,
            2, meta.max_seq_len, meta.num_seqs, rope=DecodeRope(positions, k, v, cos_sin_cache(32, 16, "cpu"),
            meta.slot_mapping),
        )  # fmt: skip


# ---- the op: atomc_triton::rope_paged_attention against atomc::rope_paged_attention ----


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("step", ["decode", "mixed"])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_backend_op_matches_the_reference_op(fused, step, qk_norm, monkeypatch):
    """Decode steps take the one-launch kernel when the switch is on; steps with prefill rows, and
    the switch off, run the RoPE + write kernel, then the attention kernel."""
    import importlib

    from atomc.forward_context import ForwardContext, set_forward_context
    from atomc.kernels import registry

    kernels = importlib.import_module("atomc.kernels.triton.paged_attention")
    monkeypatch.setattr(kernels, "ROPE_IN_DECODE_ATTENTION", fused)
    q_lens, seq_lens = ([1, 1, 1], [1, 20, 70]) if step == "decode" else ([1, 6, 1], [9, 6, 70])
    hq, hkv, d = 4, 2, 16
    q, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, hq, hkv, d, torch.float32, "cpu")
    g = torch.Generator().manual_seed(3)
    t = q.shape[0]
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)  # q, k and v as slices of one GEMM output
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    positions = torch.zeros(t, dtype=torch.int64)
    for i, (ql, sl) in enumerate(zip(q_lens, seq_lens, strict=True)):
        start = meta.query_start_loc_host[i]
        positions[start : start + ql] = torch.arange(sl - ql, sl)
    cs = cos_sin_cache(80, d, "cpu")
    qw, kw_ = (1 + 0.3 * torch.randn(d, generator=g) for _ in range(2))
    norm = (qw, 1e-6, kw_, 1e-6) if qk_norm else (None, 0.0, None, 0.0)
    launched = []
    kernel = importlib.import_module("atomc.kernels.triton.rope")
    real = kernel._rope_kernel
    monkeypatch.setattr(kernel, "_rope_kernel", _Recorder(real, launched))
    outs, pages = [], []
    for fn in (registry.lookup("rope_paged_attention", "triton"), torch.ops.atomc.rope_paged_attention.default):
        caches = (k_cache.clone(), v_cache.clone())
        out = torch.zeros_like(q, memory_format=torch.contiguous_format)
        with set_forward_context(ForwardContext(meta, [caches])):
            fn(positions, q, k, v, cs, norm[0], norm[1], norm[2], norm[3], out, 0, d**-0.5)
        outs.append(out)
        pages.append(caches)
    n = meta.query_start_loc_host[-1]
    torch.testing.assert_close(outs[0][:n], outs[1][:n], atol=1e-4, rtol=1e-4)
    for a, b in zip(pages[0], pages[1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert len(launched) == (0 if fused and step == "decode" else 1), "the RoPE kernel runs unless fused"


class _Recorder:
    def __init__(self, kernel, launched):
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, grid):
        self.launched.append(grid)
        return self.kernel[grid]
