"""Triton kernels vs torch references on CPU, through the Triton interpreter (fp32 and fp16:
the interpreter mishandles bf16). Sizes are tiny so the whole file runs in well under a minute."""

import importlib

import pytest
import torch
from triton_interpreter import use_interpreter

use_interpreter()  # before the first triton import; test_triton_gpu.py covers CUDA

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton_kernel_cases import (  # noqa: E402
    ATTN_CASES,
    WINDOW_CASES,
    LaunchRecorder,
    attention_reference,
    cos_sin_cache,
    make_batch,
    random_sinks,
    rel_err,
    release_behind_window,
    rms_norm_reference,
    rope_reference,
    silu_and_mul_reference,
)

from atomc.kernels.triton import (  # noqa: E402
    fused_add_rms_norm,
    paged_attention,
    rms_norm,
    rope,
    rope_and_write_kv,
    silu_and_mul,
    write_kv_cache,
)
from atomc.ops.attention import write_kv_cache as write_kv_cache_reference  # noqa: E402

DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@triton.jit
def _loop_probe(p):
    for _ in range(0, tl.load(p)):
        pass


def _interpreter_runs_tensor_loops() -> bool:
    # triton 3.6's interpreter calls int() on a 1-element array for a tensor-bounded range(),
    # which recent numpy rejects
    try:
        _loop_probe[(1,)](torch.ones(1, dtype=torch.int32))
        return True
    except Exception:
        return False


needs_loops = pytest.mark.skipif(
    not _interpreter_runs_tensor_loops(), reason="this triton interpreter cannot run range() over a tensor bound"
)


def run_attention(case, dtype, hq, hkv, d, num_segments=None, sinks=None, **kw):
    q_lens, seq_lens, window = WINDOW_CASES[case] if case in WINDOW_CASES else (*ATTN_CASES[case], 0)
    q, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, hq, hkv, d, dtype, "cpu")
    scale = d**-0.5
    out = torch.full_like(q, float("nan"))
    paged_attention(
        q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
        meta.max_query_len, meta.max_seq_len, meta.num_seqs, num_segments=num_segments,
        sliding_window=window, sinks=sinks, **kw,
    )  # fmt: skip
    ref = attention_reference(q, k_cache, v_cache, meta, scale, window, sinks)
    t = meta.query_start_loc_host[-1]
    assert not out[:t].isnan().any(), "a query row was not written"
    assert out[t:].isnan().all(), "padding rows must stay untouched"
    assert rel_err(out[:t], ref[:t]) < TOL[dtype]
    torch.testing.assert_close(out[:t].float(), ref[:t], atol=TOL[dtype] * 10, rtol=TOL[dtype] * 10)


@needs_loops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(ATTN_CASES))
def test_paged_attention_2d(case, dtype):
    run_attention(case, dtype, hq=4, hkv=2, d=32, num_segments=1)


@needs_loops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["decode", "mixed"])
@pytest.mark.parametrize("merge_in_kernel", [False, True])
def test_paged_attention_split_kv(case, dtype, merge_in_kernel):
    # 4 segments: the 150-token sequence spans several, short ones leave segments empty; merged by
    # the reduce kernel or by each q block's last segment program
    run_attention(case, dtype, hq=4, hkv=1, d=16, num_segments=4, merge_in_kernel=merge_in_kernel)


@needs_loops
def test_in_kernel_merge_launches_no_reduce_and_leaves_the_counters_zero(monkeypatch):
    pa = importlib.import_module("atomc.kernels.triton.paged_attention")  # the package exports the function
    monkeypatch.setattr(pa, "MERGE_IN_KERNEL_MAX_SEQS", 1)
    launched = []
    monkeypatch.setattr(pa, "_reduce_kernel", LaunchRecorder(pa._reduce_kernel, launched))
    run_attention("decode", torch.float32, hq=4, hkv=2, d=16, num_segments=8, tile_n=16, merge_in_kernel=True,
                  sinks=random_sinks(4))  # fmt: skip
    counters = importlib.import_module("atomc.kernels.triton.arrivals").counters(torch.device("cpu"), "split_kv_merge")
    assert launched == [] and not counters.any()
    run_attention("decode", torch.float32, hq=4, hkv=2, d=16, num_segments=8, tile_n=16, merge_in_kernel=False)
    assert len(launched) == 1
    # the default: in the kernel for one sequence, the reduce kernel for more
    q, k_cache, v_cache, meta = make_batch([1], [150], 4, 2, 16, torch.float32, "cpu")
    out = torch.empty_like(q)
    paged_attention(q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.25,
                    1, meta.max_seq_len, 1, num_segments=8, tile_n=16)  # fmt: skip
    assert len(launched) == 1
    ref = attention_reference(q, k_cache, v_cache, meta, 0.25, 0, None)
    assert rel_err(out[:1], ref[:1]) < TOL[torch.float32]  # the one query row (padding rows follow)


@needs_loops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["decode", "mixed", "decode_w24", "mixed_w70"])
@pytest.mark.parametrize("min_seg_tiles", [1, 4, 16])
@pytest.mark.parametrize("merge_in_kernel", [False, True])
def test_split_kv_segment_sizes(case, dtype, min_seg_tiles, merge_in_kernel):
    """Segments of at least 1, 4 or 16 16-key tiles: with 16 every sequence fits its first segment
    and its one program writes the output (no partials, the reduce skips it); with 1 the longer
    ones span several; with sinks and windows, where the reduce (or the last segment program to
    arrive: it must count the same segments) must find the same segments."""
    run_attention(case, dtype, hq=4, hkv=2, d=16, num_segments=8, tile_n=16, min_seg_tiles=min_seg_tiles,
                  sinks=random_sinks(4), merge_in_kernel=merge_in_kernel)  # fmt: skip


@needs_loops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(WINDOW_CASES))
@pytest.mark.parametrize("num_segments", [1, 4, None])
def test_paged_attention_sliding_window(case, dtype, num_segments):
    # 2D, split-KV over the window only, and the default choice; 16-key tiles so that windows
    # skip whole tiles and mask inside the boundary one
    run_attention(case, dtype, hq=4, hkv=2, d=16, num_segments=num_segments, tile_n=16)


@needs_loops
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["mixed", "decode", "prefill_w8", "decode_w24", "mixed_w70"])
@pytest.mark.parametrize("num_segments", [1, 4])
def test_paged_attention_sinks(case, dtype, num_segments):
    """Sink logits folded in after the KV loop (2D) or in the reduce (split-KV), with and without a
    window, against the reference (itself checked against an fp64 oracle); sinks in fp32 and in the
    activation dtype (a checkpoint's parameter)."""
    run_attention(case, dtype, hq=4, hkv=2, d=16, num_segments=num_segments, tile_n=16, sinks=random_sinks(4))
    run_attention(case, dtype, hq=4, hkv=2, d=16, num_segments=num_segments, tile_n=16,
                  sinks=random_sinks(4, seed=2).to(dtype))  # fmt: skip


@needs_loops
def test_paged_attention_sinks_matter_and_none_is_the_plain_kernel():
    q, k_cache, v_cache, meta = make_batch([1, 9, 1, 20], [37, 9, 100, 52], 4, 2, 16, torch.float32, "cpu")
    args = (meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.25, 20, 100, 4)
    outs = []
    for sinks in (None, random_sinks(4)):
        out = torch.zeros_like(q)
        paged_attention(q, k_cache, v_cache, out, *args, num_segments=1, sinks=sinks)
        outs.append(out)
    t = meta.query_start_loc_host[-1]
    assert not torch.allclose(outs[0][:t], outs[1][:t], atol=1e-2)
    torch.testing.assert_close(outs[0][:t], attention_reference(q, k_cache, v_cache, meta, 0.25)[:t])


@needs_loops
@pytest.mark.parametrize("segments", [1, 4])
def test_sliding_window_skips_tiles_before_the_window(segments):
    """K/V tiles that lie wholly before every query's window are never read: poisoned with NaN there
    (a NaN in V reaches the output even through a zero softmax weight), the output stays the
    reference's. One decode far past the window and one chunked prefill over a long cached prefix."""
    q, k_cache, v_cache, meta = make_batch([1, 4], [300, 200], 4, 2, 16, torch.float32, "cpu", pad_tokens=0)
    window, tile = 24, 16
    ref = attention_reference(q, k_cache, v_cache, meta, 0.25, window)
    for i, (seq_len, q_len) in enumerate([(300, 1), (200, 4)]):
        first_tile = (seq_len - q_len - (window - 1)) // tile  # the tile of the earliest visible key
        for pos in range(first_tile * tile):
            page = int(meta.block_tables[i, pos // 16])
            k_cache[page, pos % 16] = float("nan")
            v_cache[page, pos % 16] = float("nan")
    args = (q, k_cache, v_cache, None, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.25, 4, 300, 2)
    for window_arg in (window, 0):
        out = torch.empty_like(q)
        paged_attention(*args[:3], out, *args[4:], num_segments=segments, tile_n=tile, sliding_window=window_arg)
        if window_arg:
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        else:
            assert out.isnan().all()  # full attention reads the poisoned keys: the poison is live


@needs_loops
@pytest.mark.parametrize("segments", [1, 4])
@pytest.mark.parametrize("case", ["chunked_prefill_w20", "decode_w24", "mixed_w70"])
def test_sliding_window_over_released_blocks(case, segments):
    """A windowed KV group's tables: the entries of blocks released behind the window hold its null
    block (zeros). With the default 64-key tiles the kernel's first tile can start up to 3 pages
    before the window's first page, so it may load those entries; they are masked, and the output
    equals the reference over the real tables."""
    q_lens, seq_lens, window = WINDOW_CASES[case]
    q, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, 4, 2, 16, torch.float32, "cpu")
    ref = attention_reference(q, k_cache, v_cache, meta, 0.25, window)
    released = release_behind_window(meta, k_cache, v_cache, window, 0.0)
    out = torch.zeros_like(q)
    paged_attention(
        q, k_cache, v_cache, out, released.query_start_loc, released.seq_lens, released.block_tables, 0.25,
        meta.max_query_len, meta.max_seq_len, meta.num_seqs, num_segments=segments, sliding_window=window,
    )  # fmt: skip
    t = meta.query_start_loc_host[-1]
    torch.testing.assert_close(out[:t], ref[:t], atol=1e-5, rtol=1e-5)


@needs_loops
@pytest.mark.parametrize("hq,hkv,d", [(6, 2, 16), (2, 2, 64)])
def test_paged_attention_heads(hq, hkv, d):
    # non-power-of-2 GQA group, plain MHA with a wider head; default path choice
    run_attention("decode", torch.float32, hq, hkv, d)
    run_attention("chunked_prefill", torch.float32, hq, hkv, d)


@needs_loops
@pytest.mark.parametrize("window", [0, 24])
def test_paged_attention_seq_len_upper_bound(window):
    # CUDA-graph decode passes an upper bound for max_seq_len; results must not change
    q, k_cache, v_cache, meta = make_batch([1, 1], [20, 90], 4, 2, 16, torch.float32, "cpu", pad_tokens=0)
    ref = attention_reference(q, k_cache, v_cache, meta, 0.25, window)
    for bound, segs in [(90, None), (4096, None), (4096, 8)]:
        out = torch.full_like(q, float("nan"))
        paged_attention(
            q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.25,
            1, bound, 2, num_segments=segs, sliding_window=window,
        )  # fmt: skip
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_split_kv_segment_choice(monkeypatch):
    module = importlib.import_module("atomc.kernels.triton.paged_attention")  # the package re-exports the function
    monkeypatch.setattr(module, "_num_sms", lambda index: 132)  # an H200
    gpu = torch.device("cuda", 0)
    pick = lambda seqs, max_len: module._pick_segments(gpu, seqs, 8, max_len, 64)  # 8 KV heads, 64-key tiles
    assert pick(8, 4096) == pick(8, 16384) == 8  # the H200 sweep's best: 512 programs
    assert pick(16, 4096) == 4 and pick(32, 4096) == 2 and pick(64, 4096) == 1
    assert pick(1, 1024) == 8  # 8 segments of 2 tiles fill a 1k context
    assert pick(1, 131072) == 16  # the cap; short sequences then leave segments empty


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache(dtype):
    g = torch.Generator().manual_seed(1)
    k = torch.randn(6, 2, 16, generator=g).to(dtype)
    v = torch.randn(6, 2, 16, generator=g).to(dtype)
    slots = torch.tensor([3, 17, -1, 40, 0, -1])
    caches = [torch.full((4, 16, 2, 16), float("nan"), dtype=dtype) for _ in range(4)]
    write_kv_cache(k, v, caches[0], caches[1], slots)
    write_kv_cache_reference(k, v, caches[2], caches[3], slots)
    torch.testing.assert_close(caches[0], caches[2], equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(caches[1], caches[3], equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 100])
def test_rms_norm(dtype, n):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, n, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    out = torch.full_like(x, float("nan"))
    rms_norm(x, w, 1e-6, out=out)
    torch.testing.assert_close(out, rms_norm_reference(x, w, 1e-6), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 96, generator=g).to(dtype)
    r = torch.randn(5, 96, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    new_r = x + r
    ref = rms_norm_reference(new_r, w, 1e-5)
    out, res = fused_add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(res, new_r, atol=0, rtol=0)
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    # in place: out=x, residual_out=residual
    fused_add_rms_norm(x, r, w, 1e-5, out=x, residual_out=r)
    torch.testing.assert_close(r, new_r, atol=0, rtol=0)
    torch.testing.assert_close(x, ref, atol=TOL[dtype], rtol=TOL[dtype])


def _rope_inputs(dtype, d=32, t=5, hq=4, hkv=2):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(t, hkv, d, generator=g).to(dtype)
    v = torch.randn(t, hkv, d, generator=g).to(dtype)
    positions = torch.tensor([0, 7, 3, 63, 12])[:t]
    return positions, q, k, v, cos_sin_cache(64, d, "cpu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [32, 24])
def test_rope(dtype, d):
    positions, q, k, _, cs = _rope_inputs(dtype, d)
    q_ref, k_ref = rope_reference(positions, q, cs), rope_reference(positions, k, cs)
    rope(positions, q, k, cs)
    torch.testing.assert_close(q, q_ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(k, k_ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_write_kv(dtype):
    positions, q, k, v, cs = _rope_inputs(dtype)
    q_ref, k_ref = rope_reference(positions, q, cs), rope_reference(positions, k, cs)
    slots = torch.tensor([5, -1, 33, 2])  # shorter than T: the last row is rotated, not written
    kc, vc = (torch.full((3, 16, 2, 32), float("nan"), dtype=dtype) for _ in range(2))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv_cache_reference(k_ref, v, kc_ref, vc_ref, slots)
    rope_and_write_kv(positions, q, k, v, cs, kc, vc, slots)
    torch.testing.assert_close(q, q_ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(k, k_ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(kc, kc_ref, atol=TOL[dtype], rtol=TOL[dtype], equal_nan=True)
    torch.testing.assert_close(vc, vc_ref, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [32, 24])
@pytest.mark.parametrize("split_qk", [True, False])
def test_qk_norm_then_rope_and_write_kv(dtype, d, split_qk, monkeypatch):
    rope_module = importlib.import_module("atomc.kernels.triton.rope")
    monkeypatch.setattr(rope_module, "SPLIT_QK", split_qk)  # q and k in two programs a token, or one
    from atomc.ops.norm import rms_norm_reference

    positions, q, k, v, cs = _rope_inputs(dtype, d)
    g = torch.Generator().manual_seed(6)
    qw, kw = (1 + 0.5 * torch.randn(d, generator=g)).to(dtype), (1 + 0.5 * torch.randn(d, generator=g)).to(dtype)
    q, k = 3 * q, 0.5 * k  # norms that differ from 1
    q_ref = rope_reference(positions, rms_norm_reference(q, qw, 1e-6), cs)
    k_ref = rope_reference(positions, rms_norm_reference(k, kw, 1e-6), cs)
    slots = torch.tensor([5, -1, 33, 2, 17])
    kc, vc = (torch.full((3, 16, 2, d), float("nan"), dtype=dtype) for _ in range(2))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    write_kv_cache_reference(k_ref, v, kc_ref, vc_ref, slots)
    rope_and_write_kv(positions, q, k, v, cs, kc, vc, slots, qk_norm=(qw, 1e-6, kw, 1e-6))
    tol = TOL[dtype] * 4  # the norm adds two roundings before the rotation
    torch.testing.assert_close(q, q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(k, k_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(kc, kc_ref, atol=tol, rtol=tol, equal_nan=True)
    torch.testing.assert_close(vc, vc_ref, atol=0, rtol=0, equal_nan=True)
    q2, k2 = (torch.randn(5, 4, d, generator=g).to(dtype), torch.randn(5, 2, d, generator=g).to(dtype))
    want_q = rope_reference(positions, rms_norm_reference(q2, qw, 1e-6), cs)
    rope(positions, q2, k2, cs, qk_norm=(qw, 1e-6, kw, 1e-6))  # without a cache
    torch.testing.assert_close(q2, want_q, atol=tol, rtol=tol)


def test_qk_norm_rope_backend_op_matches_the_atomc_op():
    # what a lowered Qwen3 graph calls on CUDA, against the reference op (no forward context: rotate only)
    from atomc.kernels import registry

    positions, q, k, v, cs = _rope_inputs(torch.float32, 32)
    g = torch.Generator().manual_seed(7)
    qw, kw = 1 + 0.5 * torch.randn(32, generator=g), 1 + 0.5 * torch.randn(32, generator=g)
    args = (positions, 3 * q, k, v, qw, 1e-6, kw, 1e-5, cs, 0)
    got = registry.lookup("qk_norm_rope_and_write_kv", "triton")(*args)
    want = torch.ops.atomc.qk_norm_rope_and_write_kv.default(*args)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _qkv_slices(dtype, t=5, hq=4, hkv=2, d=32):
    """(qkv, q, k, v) as the attention layer has them: q/k/v are views of one fused qkv GEMM output,
    with its token stride (not contiguous for t > 1)."""
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=torch.Generator().manual_seed(8)).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return qkv, q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)


def _head_norms(dtype, d=32):
    """(q_weight, q_eps, k_weight, k_eps) of per-head RMSNorms (Qwen3's q_norm / k_norm)."""
    g = torch.Generator().manual_seed(9)
    q_weight, k_weight = ((1 + 0.5 * torch.randn(d, generator=g)).to(dtype) for _ in range(2))
    return q_weight, 1e-6, k_weight, 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_reads_qkv_slices_and_writes_given_outputs(dtype, qk_norm):
    """Rotating strided q/k into other tensors gives the bits of rotating contiguous copies in place
    (the same arithmetic), writes the same cache, and leaves the qkv output untouched."""
    qkv, q, k, v = _qkv_slices(dtype)
    positions, cs = torch.tensor([0, 7, 3, 63, 12]), cos_sin_cache(64, 32, "cpu")
    norm = _head_norms(dtype) if qk_norm else None
    slots = torch.tensor([5, -1, 33, 2, 17])
    kc, vc, kc_ref, vc_ref = (torch.full((3, 16, 2, 32), float("nan"), dtype=dtype) for _ in range(4))
    before = qkv.clone()
    q_ref, k_ref = rope_and_write_kv(positions, q.contiguous(), k.contiguous(), v, cs, kc_ref, vc_ref, slots, norm)
    out = torch.full_like(q_ref, float("nan")), torch.full_like(k_ref, float("nan"))
    got = rope_and_write_kv(positions, q, k, v, cs, kc, vc, slots, qk_norm=norm, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    assert torch.equal(out[0], q_ref) and torch.equal(out[1], k_ref)
    torch.testing.assert_close(kc, kc_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(vc, vc_ref, atol=0, rtol=0, equal_nan=True)
    rotated = torch.empty_like(q_ref), torch.empty_like(k_ref)
    rope(positions, q, k, cs, qk_norm=norm, out=rotated)  # rotate only
    assert torch.equal(rotated[0], q_ref) and torch.equal(rotated[1], k_ref)
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("name", ["rope", "rope_and_write_kv", "qk_norm_rope_and_write_kv"])
def test_backend_rope_ops_take_qkv_slices_without_copies(name, t):
    """The lowered graph's RoPE ops on the qkv slices: the atomc op's values and cache, and no
    tensor copy outside the kernel. They used to rotate copies of q and k: two device memcpys a
    layer in the H200 decode step (Llama-3.1-8B, Qwen3-30B-A3B), more past batch 1."""
    from atomc.forward_context import AttentionMetadata, ForwardContext, set_forward_context
    from atomc.kernels import registry
    from tests.device_copies import copies_outside_kernels

    _, q, k, v = _qkv_slices(torch.float32, t)
    positions, cs = torch.tensor([0, 7, 3, 63, 12])[:t], cos_sin_cache(64, 32, "cpu")
    args = {
        "rope": (positions, q, k, cs),
        "rope_and_write_kv": (positions, q, k, v, cs, 0),
        "qk_norm_rope_and_write_kv": (positions, q, k, v, *_head_norms(torch.float32), cs, 0),
    }[name]
    meta = AttentionMetadata(torch.tensor([5, -1, 33, 2, 17])[:t], torch.tensor([0, t]), torch.tensor([t]), None)
    got_cache, want_cache = (tuple(torch.zeros(3, 16, 2, 32) for _ in range(2)) for _ in range(2))
    got = []
    with set_forward_context(ForwardContext(meta, [got_cache])):
        copies = copies_outside_kernels(lambda: got.extend(registry.lookup(name, "triton")(*args)))
    with set_forward_context(ForwardContext(meta, [want_cache])):
        want = getattr(torch.ops.atomc, name).default(*args)
    assert copies == {}
    for a, b in zip((*got, *got_cache), (*want, *want_cache), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert all(x.is_contiguous() for x in got)  # what the ops' fake (empty_like of a slice) promises Inductor


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [48, 1500])
def test_silu_and_mul(dtype, inter):
    g = torch.Generator().manual_seed(5)
    x = (3 * torch.randn(3, 2 * inter, generator=g)).to(dtype)
    out = torch.full((3, inter), float("nan"), dtype=dtype)
    silu_and_mul(x, out=out)
    torch.testing.assert_close(out, silu_and_mul_reference(x), atol=TOL[dtype], rtol=TOL[dtype])


@needs_loops
@pytest.mark.parametrize("segments", [1, 4])
def test_paged_attention_empty_sequence(segments):
    # a padding sequence (seq_len 0, as a padded CUDA-graph batch may carry) writes zeros, not NaN
    q, k_cache, v_cache, meta = make_batch([1, 1], [20, 90], 4, 2, 16, torch.float32, "cpu", pad_tokens=0)
    ref = attention_reference(q, k_cache, v_cache, meta, 0.25)
    seq_lens = meta.seq_lens.clone()
    seq_lens[1] = 0
    out = torch.full_like(q, float("nan"))
    paged_attention(
        q, k_cache, v_cache, out, meta.query_start_loc, seq_lens, meta.block_tables, 0.25,
        1, 90, 2, num_segments=segments,
    )  # fmt: skip
    torch.testing.assert_close(out[0], ref[0], atol=1e-5, rtol=1e-5)
    assert (out[1] == 0).all()


@needs_loops
@pytest.mark.parametrize("case", ["mixed", "chunked_prefill", "mixed_w70", "chunked_prefill_w20"])
def test_paged_attention_mixed_graph_layout(case):
    """The layout a mixed-batch CUDA graph replays: metadata for `max_seqs` sequences where the ones
    after the real ones are empty (start = end = real tokens, seq_len 0), extra padded tokens owned
    by no sequence, num_seqs = max_seqs and max_query_len > 1. Real rows match the unpadded call;
    padded rows stay untouched."""
    q_lens, seq_lens, window = WINDOW_CASES[case] if case in WINDOW_CASES else (*ATTN_CASES[case], 0)
    q, k_cache, v_cache, meta = make_batch(q_lens, seq_lens, 4, 2, 16, torch.float32, "cpu", pad_tokens=5)
    t, n, max_seqs = meta.query_start_loc_host[-1], len(seq_lens), len(seq_lens) + 6
    qsl = torch.full((max_seqs + 1,), t, dtype=torch.int32)
    qsl[: n + 1] = meta.query_start_loc
    lens = torch.zeros(max_seqs, dtype=torch.int32)
    lens[:n] = meta.seq_lens
    tables = torch.zeros(max_seqs, meta.block_tables.shape[1], dtype=torch.int32)
    tables[:n] = meta.block_tables
    ref = attention_reference(q, k_cache, v_cache, meta, 0.25, window)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k_cache, v_cache, out, qsl, lens, tables, 0.25, 2, 4096, max_seqs, sliding_window=window)
    torch.testing.assert_close(out[:t], ref[:t], atol=1e-5, rtol=1e-5)
    assert out[t:].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (3, 100, 200), (16, 33, 520)])
@pytest.mark.parametrize("split_k", [1, 3])
def test_gemv(dtype, m, n, k, split_k):
    from atomc.kernels.triton.gemv import gemv

    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    for bias in (None, b):
        out = gemv(x, w, bias, block_n=16, block_k=64, split_k=split_k)
        ref = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())
        assert out.shape == (m, n) and out.dtype == dtype
        torch.testing.assert_close(out.float(), ref, atol=TOL[dtype] * 10, rtol=TOL[dtype] * 10)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k,block_n,block_k", [(48, 64, 16, 64), (37, 200, 4, 64), (5, 520, 8, 128)])
def test_gemv_reduce(dtype, n, k, block_n, block_k):
    from atomc.kernels.triton.gemv import gemv

    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    for bias in (None, b):
        out = gemv(x, w, bias, block_n=block_n, block_k=block_k, kernel="reduce")
        ref = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())
        assert out.shape == (1, n) and out.dtype == dtype
        torch.testing.assert_close(out.float(), ref, atol=TOL[dtype] * 10, rtol=TOL[dtype] * 10)


def test_linear_uses_the_gemv_for_one_row_only(monkeypatch):
    from atomc.kernels.triton import gemv as module

    calls = []
    real = module.gemv
    monkeypatch.setattr(module, "gemv", lambda *a, **kw: calls.append(kw["kernel"]) or real(*a, **kw))
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(40, 96, generator=g) / 96**0.5).to(torch.float16)
    b = torch.randn(40, generator=g).to(torch.float16)
    for shape in ((1, 96), (1, 1, 96), (3, 96), (0, 96)):
        x = torch.randn(*shape, generator=g).to(torch.float16)
        out = module.linear(x, w, b)
        ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
        assert out.shape == ref.shape
        torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
    assert calls == ["reduce", "reduce"]  # the two one-row shapes; 3 rows and 0 rows go to F.linear


def test_gemv_reduce_takes_one_row():
    from atomc.kernels.triton.gemv import gemv

    with pytest.raises(ValueError, match="one row"):
        gemv(torch.zeros(2, 8), torch.zeros(4, 8), kernel="reduce")


def test_gemv_rejects_wide_batches():
    from atomc.kernels.triton.gemv import gemv

    with pytest.raises(ValueError, match="M<=16"):
        gemv(torch.zeros(17, 8), torch.zeros(4, 8))


@needs_loops
@pytest.mark.parametrize("op", ["attention", "paged_attention"])
def test_attention_backend_ops_take_sinks(op):
    """The lowered graph's call (sinks as the schema's last argument) against the atomc op, through a
    forward context that holds the paged cache; and without a context (one causal sequence)."""
    from atomc.forward_context import ForwardContext, set_forward_context
    from atomc.kernels import registry

    q, k_cache, v_cache, meta = make_batch([1, 9, 1, 20], [37, 9, 100, 52], 4, 2, 16, torch.float32, "cpu")
    g = torch.Generator().manual_seed(9)
    k, v = torch.randn(q.shape[0], 2, 16, generator=g), torch.randn(q.shape[0], 2, 16, generator=g)
    sinks = random_sinks(4)
    outs = []
    for fn in (registry.lookup(op, "triton"), getattr(torch.ops.atomc, op).default):
        caches = (k_cache.clone(), v_cache.clone())
        out = torch.zeros_like(q)
        with set_forward_context(ForwardContext(meta, [caches])):
            fn(q, k, v, out, 0, 0.25, 24, sinks)
        outs.append(out)
    t = meta.query_start_loc_host[-1]
    torch.testing.assert_close(outs[0][:t], outs[1][:t], atol=1e-5, rtol=1e-5)
    no_cache = [torch.zeros(12, 4, 16) for _ in range(2)]
    for out, fn in zip(no_cache, (registry.lookup(op, "triton"), getattr(torch.ops.atomc, op).default), strict=True):
        fn(q[:12], k[:12], v[:12], out, 0, 0.25, 5, sinks)
    torch.testing.assert_close(no_cache[0], no_cache[1], atol=0, rtol=0)
