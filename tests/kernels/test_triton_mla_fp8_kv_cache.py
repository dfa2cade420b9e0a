"""FP8 (e4m3) latent cache for MLA: the Triton latent write and the Triton MLA kernel (decode with
and without split-KV, prefill over a cached prefix, mixed batches) against atomc::mla_attention's
torch reference, on CPU through the Triton interpreter, fp32 and fp16 queries.

The pages hold [c_kv | k_pe] / kv_scale, one scale a layer for the whole row. The write is compared
byte for byte with the reference's (the interpreter rounds to the e4m3 grid in fp32 arithmetic
first, as test_triton_fp8_kv_cache.py explains). The kernel reads the same stored bytes as the
reference, so their tolerance is the unquantised kernel's (TOL); against attention over the
unquantised latent the error is e4m3's (3 mantissa bits, about 2^-4 relative a value, and both the
scores and the values see it), bounded below at 6%.
"""

import pytest
import torch
from triton_interpreter import use_interpreter

use_interpreter()  # before the first triton import; the GPU file covers CUDA

triton = pytest.importorskip("triton")
from triton_kernel_cases import make_batch, rel_err  # noqa: E402

import atomc.ops  # noqa: E402, F401
from atomc.forward_context import ForwardContext, set_forward_context  # noqa: E402
from atomc.kernels.triton import mla_attention, write_latent_cache  # noqa: E402
from atomc.kernels.triton.fp8_quant import ROUND_IN_FP32  # noqa: E402
from atomc.ops.attention import FP8_MAX, paged_attention_reference, quantize_kv  # noqa: E402
from atomc.ops.mla import write_latent_cache as write_reference  # noqa: E402

FP8 = torch.float8_e4m3fn
LORA, ROPE, PAGE = 40, 8, 8
TOL = {torch.float32: 1e-5, torch.float16: 3e-3}
DTYPES = [torch.float32, torch.float16]
SCALE = 0.02  # the latent values drawn below stay under 448 * SCALE: no saturation in attention tests
CASES = {  # (query tokens, context lengths) per sequence
    "decode": ([1, 1, 1, 1], [3, 41, 17, 64]),
    "prefill_over_prefix": ([5, 13], [21, 13]),
    "mixed": ([1, 9, 1, 4], [30, 9, 8, 23]),
}


def fp8_latent_batch(case, dtype, heads=4, kv_scale=SCALE, lora=LORA, rope=ROPE, seed=0):
    """q_absorbed, q_pe, FP8 latent pages [blocks, PAGE, 1, lora + rope] (the drawn values times 2,
    quantised with `kv_scale`), the scale, the metadata and the unquantised pages."""
    q, values, _, meta = make_batch(*CASES[case], heads, 1, lora + rope, torch.float32, "cpu", page=PAGE, seed=seed)
    values = values * 2
    scale = torch.tensor([kv_scale])
    q = q.to(dtype)
    return q[..., :lora], q[..., lora:], quantize_kv(values, FP8, scale), scale, meta, values


def reference(q_absorbed, q_pe, cache, meta, scale, kv_scale):
    """atomc::mla_attention's read: MQA of [q_absorbed | q_pe] over the latent, values its c_kv part,
    `kv_scale` dequantising both (None: the pages as they are)."""
    out = torch.zeros(*q_absorbed.shape, dtype=torch.float32)
    lora = q_absorbed.shape[-1]
    q = torch.cat([q_absorbed, q_pe], -1).float()
    pair = None if kv_scale is None else (kv_scale, kv_scale)
    paged_attention_reference(q, cache, cache[..., :lora], out, meta, scale, kv_scales=pair)
    return out


def check(case, dtype, heads=4, lora=LORA, rope=ROPE, **kw):
    q_absorbed, q_pe, cache, kv_scale, meta, values = fp8_latent_batch(case, dtype, heads, lora=lora, rope=rope)
    scale = 0.15
    out = torch.full(q_absorbed.shape, float("nan"), dtype=dtype)
    mla_attention(
        q_absorbed, q_pe, cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
        meta.max_query_len, meta.max_seq_len, meta.num_seqs, kv_scale=kv_scale, **kw,
    )  # fmt: skip
    t = meta.query_start_loc_host[-1]
    assert not out[:t].isnan().any() and out[t:].isnan().all()
    ref = reference(q_absorbed, q_pe, cache, meta, scale, kv_scale)
    assert rel_err(out[:t], ref[:t]) < TOL[dtype]
    # and e4m3's error against attention over the unquantised latent
    exact = reference(q_absorbed, q_pe, values, meta, scale, None)
    err = rel_err(out[:t], exact[:t])
    assert 1e-4 < err < 0.06, f"FP8 latent error {err:.3g} against the unquantised latent"


@pytest.mark.parametrize("segments", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_over_fp8_pages(dtype, segments):
    # split 4 ways with 16-key tiles: the scale must reach the partials before the merge
    check("decode", dtype, num_segments=segments, tile_n=16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_over_a_cached_fp8_prefix(dtype):
    check("prefill_over_prefix", dtype, tile_n=16)


def test_mixed_batch_with_head_blocks_and_c_kv_halves():
    check("mixed", torch.float16, heads=6, block_h=2, tile_n=16, dv_split=2)


def test_64_head_tiles_over_fp8_pages():
    # V3's decode tiling (64 heads a tile, c_kv halves) over unpadded widths, split-KV
    check("decode", torch.float16, heads=80, lora=64, rope=16, block_h=64, tile_n=16, num_warps=8, num_segments=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_latent_write_stores_the_reference_bytes(dtype):
    g = torch.Generator().manual_seed(3)
    c_kv = (torch.randn(6, LORA, generator=g) * 3).to(dtype)
    k_pe = (torch.randn(6, ROPE, generator=g) * 3).to(dtype)
    c_kv[0, :3] = torch.tensor([1e4, -1e4, 124.3 * 0.03])  # saturation both ways; a carry into the exponent
    k_pe[1, 0] = -1e4  # the rope part saturates too
    slots = torch.tensor([17, 3, -1, 40, 8, -1])
    kv_scale = torch.tensor([0.03])
    got = torch.zeros(7, PAGE, 1, LORA + ROPE, dtype=FP8)
    want = torch.zeros_like(got)
    write_latent_cache(c_kv, k_pe, got, slots, kv_scale)
    write_reference(torch.cat([c_kv, k_pe], -1).unsqueeze(1), want, slots, kv_scale)
    assert ROUND_IN_FP32  # the interpreter's write rounds in fp32 arithmetic (module docstring)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) and got.float().count_nonzero() > 0
    assert got.float().abs().max() == FP8_MAX
    # the quantisation itself: dequantised rows are the latent within e4m3's relative step
    rows = want.view(-1, LORA + ROPE)[slots[slots >= 0]].float() * kv_scale
    latent = torch.cat([c_kv, k_pe], -1)[slots >= 0].float().clamp(-FP8_MAX * 0.03, FP8_MAX * 0.03)
    assert ((rows - latent).abs() <= latent.abs() * 2**-4 + 2**-9 * 0.03).all()


def test_fp8_latent_pages_without_a_scale_are_refused():
    cache = torch.zeros(4, PAGE, 1, LORA + ROPE, dtype=FP8)
    with pytest.raises(ValueError, match="needs its layer's kv_scale"):
        write_latent_cache(torch.randn(2, LORA), torch.randn(2, ROPE), cache, torch.tensor([0, 1]))


def test_op_binding_reads_the_scale_from_the_forward_context():
    """atomc_triton::mla_attention against atomc::mla_attention, FP8 pages in both and the layer's
    scale pair from the forward context: the same bytes written, the same outputs."""
    import atomc.kernels.triton.ops  # noqa: F401  (defines torch.ops.atomc_triton.*)

    heads, scale = 4, 0.2
    q_absorbed, q_pe, cache, kv_scale, meta, _ = fp8_latent_batch("mixed", torch.float32, heads, seed=1)
    g = torch.Generator().manual_seed(2)
    rows = q_absorbed.shape[0]
    c_kv, k_pe = torch.randn(rows, LORA, generator=g), torch.randn(rows, ROPE, generator=g)
    outs, caches = [], []
    for op in (torch.ops.atomc.mla_attention, torch.ops.atomc_triton.mla_attention):
        latent = cache.clone()
        out = torch.zeros(rows, heads, LORA)
        ctx = ForwardContext(meta, [(latent, latent[..., :LORA])], kv_scales=[(kv_scale, kv_scale)])
        with set_forward_context(ctx):
            op(q_absorbed, q_pe, c_kv, k_pe, out, 0, scale)
        outs.append(out)
        caches.append(latent)
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    assert not torch.equal(caches[0].view(torch.uint8), cache.view(torch.uint8))  # it wrote
    t = meta.query_start_loc_host[-1]
    assert rel_err(outs[1][:t], outs[0][:t]) < 1e-5
