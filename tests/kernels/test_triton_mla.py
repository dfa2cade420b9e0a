"""The Triton MLA kernel (atomc/kernels/triton/mla_attention.py) against atomc::mla_attention's
torch reference on the CPU, through the Triton interpreter (fp32 and fp16: the interpreter
mishandles bf16). Tiny widths that are not all powers of two (kv_lora 40, rope 8), pages of 8
tokens so contexts span several pages, pages shuffled over the pool, padding rows after the batch:
decode with and without split-KV, prefill over a cached prefix, mixed batches, several head blocks;
then the op binding (atomc_triton::mla_attention) through the forward context, cache write included."""

import importlib

import pytest
import torch
from triton_interpreter import use_interpreter

use_interpreter()  # before the first triton import; test_triton_mla_gpu.py covers CUDA

triton = pytest.importorskip("triton")
from triton_kernel_cases import make_batch, rel_err  # noqa: E402

from atomc.forward_context import ForwardContext, set_forward_context  # noqa: E402
from atomc.kernels.triton import mla_attention, write_latent_cache  # noqa: E402
from atomc.ops.attention import paged_attention_reference  # noqa: E402
from atomc.ops.mla import write_latent_cache as write_latent_reference  # noqa: E402

LORA, ROPE, PAGE = 40, 8, 8
TOL = {torch.float32: 1e-5, torch.float16: 3e-3}
DTYPES = [torch.float32, torch.float16]
CASES = {  # (query tokens, context lengths) per sequence
    "decode": ([1, 1, 1, 1], [3, 41, 17, 64]),
    "prefill_over_prefix": ([5, 13], [21, 13]),
    "mixed": ([1, 9, 1, 4], [30, 9, 8, 23]),
}


def latent_batch(q_lens, seq_lens, heads, dtype, seed=0, lora=LORA, rope=ROPE):
    """q_absorbed, q_pe, the latent pages [blocks, PAGE, 1, lora + rope] and the metadata."""
    q, cache, _, meta = make_batch(q_lens, seq_lens, heads, 1, lora + rope, dtype, "cpu", page=PAGE, seed=seed)
    return q[..., :lora], q[..., lora:], cache, meta  # strided views, as the model's q_absorbed is


def reference(q_absorbed, q_pe, cache, meta, scale):
    """What atomc::mla_attention computes: MQA of [q_absorbed | q_pe] over the latent, values c_kv."""
    out = torch.zeros(*q_absorbed.shape, dtype=q_absorbed.dtype)
    lora = q_absorbed.shape[-1]
    paged_attention_reference(torch.cat([q_absorbed, q_pe], -1), cache, cache[..., :lora], out, meta, scale)
    return out


def check(case, dtype, heads=4, lora=LORA, rope=ROPE, **kw):
    q_absorbed, q_pe, cache, meta = latent_batch(*CASES[case], heads, dtype, lora=lora, rope=rope)
    scale = 0.15
    out = torch.full(q_absorbed.shape, float("nan"), dtype=dtype)
    mla_attention(
        q_absorbed, q_pe, cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
        meta.max_query_len, meta.max_seq_len, meta.num_seqs, **kw,
    )  # fmt: skip
    t = meta.query_start_loc_host[-1]
    assert not out[:t].isnan().any()
    assert out[t:].isnan().all()  # padding rows are left alone
    assert rel_err(out[:t], reference(q_absorbed, q_pe, cache, meta, scale)[:t]) < TOL[dtype]


@pytest.mark.parametrize("segments", [1, 4, None], ids=["one_segment", "split4", "auto"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_over_uneven_contexts(dtype, segments):
    # split 4 ways with 16-key tiles: the 64-key context fills every segment, the 3-key one leaves
    # three empty (their partials must weigh nothing in the merge)
    check("decode", dtype, num_segments=segments, tile_n=16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_split_with_several_head_blocks(dtype):
    check("decode", dtype, heads=6, num_segments=2, block_h=4, tile_n=16)  # heads 6, 7 of block 1 masked


def test_decode_with_a_wide_head_tile():
    # 20 heads in one 32-row tile (the benchmark's block_h 32 / 64 configs): rows 20..31 masked
    check("decode", torch.float32, heads=20, num_segments=2, block_h=32, tile_n=16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_over_a_cached_prefix(dtype):
    check("prefill_over_prefix", dtype, tile_n=16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_batch_with_head_blocks(dtype):
    check("mixed", dtype, heads=6, block_h=2, tile_n=16)  # 32 rows: 16 tokens x 2 heads a tile


def test_forced_split_over_a_mixed_batch_is_exact():
    # a forced split over a prefill batch is still exact (the causal range is cut, then merged)
    check("mixed", torch.float32, num_segments=2, tile_n=16)


def test_latent_cache_write_matches_the_reference():
    g = torch.Generator().manual_seed(3)
    c_kv, k_pe = torch.randn(6, LORA, generator=g), torch.randn(6, ROPE, generator=g)
    slots = torch.tensor([17, 3, -1, 40, 8, -1])
    got = torch.zeros(7, PAGE, 1, LORA + ROPE)
    want = got.clone()
    write_latent_cache(c_kv, k_pe, got, slots)
    write_latent_reference(torch.cat([c_kv, k_pe], -1).unsqueeze(1), want, slots)
    assert torch.equal(got, want) and got.count_nonzero() == 4 * (LORA + ROPE)


def test_op_binding_writes_the_cache_and_attends_like_the_reference():
    """atomc_triton::mla_attention through the forward context against atomc::mla_attention: the
    same step's latent rows land in the same slots and the outputs agree; without a cache both
    attend causally over the batch."""
    import atomc.kernels.triton.ops  # noqa: F401  (defines torch.ops.atomc_triton.*)

    heads, scale = 4, 0.2
    q_absorbed, q_pe, cache, meta = latent_batch(*CASES["mixed"], heads, torch.float32, seed=1)
    g = torch.Generator().manual_seed(2)
    rows = q_absorbed.shape[0]
    c_kv, k_pe = torch.randn(rows, LORA, generator=g), torch.randn(rows, ROPE, generator=g)
    outs, caches = [], []
    for op in (torch.ops.atomc.mla_attention, torch.ops.atomc_triton.mla_attention):
        latent = cache.clone()
        out = torch.zeros(rows, heads, LORA)
        with set_forward_context(ForwardContext(meta, [(latent, latent[..., :LORA])])):
            op(q_absorbed, q_pe, c_kv, k_pe, out, 0, scale)
        outs.append(out)
        caches.append(latent)
    assert torch.equal(caches[0], caches[1]) and not torch.equal(caches[0], cache)
    t = meta.query_start_loc_host[-1]
    assert rel_err(outs[1][:t], outs[0][:t]) < 1e-5
    plain = [torch.zeros(rows, heads, LORA) for _ in range(2)]
    torch.ops.atomc.mla_attention(q_absorbed, q_pe, c_kv, k_pe, plain[0], 0, scale)
    torch.ops.atomc_triton.mla_attention(q_absorbed, q_pe, c_kv, k_pe, plain[1], 0, scale)
    assert torch.equal(plain[0], plain[1])


@pytest.mark.parametrize("segments", [1, 4])
def test_graph_padding_sequences_write_zeros_and_leave_the_rest_alone(segments):
    """A CUDA graph's batch pads with sequences of no context (one query, seq_len 0: zeros out)
    and with empty ones (no query at all), and passes max_seq_len as an upper bound."""
    q_lens, seq_lens = [1, 4, 1, 0, 1], [37, 20, 0, 0, 9]
    q_absorbed, q_pe, cache, meta = latent_batch(q_lens, seq_lens, 4, torch.float32)
    meta.max_seq_len = 512
    out = torch.full(q_absorbed.shape, float("nan"))
    mla_attention(
        q_absorbed, q_pe, cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.2,
        meta.max_query_len, meta.max_seq_len, meta.num_seqs, num_segments=segments, tile_n=16,
    )  # fmt: skip
    ref = reference(q_absorbed, q_pe, cache, meta, 0.2)
    live = [0, 1, 2, 3, 4, 6]  # token 5 is the context-less sequence's query
    assert torch.equal(out[5], torch.zeros_like(out[5]))
    assert rel_err(out[live], ref[live]) < TOL[torch.float32]
    assert out[7:].isnan().all()


# --- the compute-bound tiling: 64-head tiles, c_kv halves, one-wave split-KV ------------------------


@pytest.mark.parametrize("dv_split", [1, 2])
@pytest.mark.parametrize("case", ["decode", "mixed"])
def test_64_head_tiles_over_heads_they_do_not_divide(case, dv_split):
    # 80 heads in tiles of 64 (V3's tiling, 2 head blocks): the second block has 16 live rows; a
    # mixed batch packs one token's 64 heads a prefill tile (causal mask on)
    check(case, torch.float16, heads=80, block_h=64, tile_n=16, num_warps=8, dv_split=dv_split)


@pytest.mark.parametrize("dv_split", [1, 2])
@pytest.mark.parametrize("segments", [1, 4])
def test_unpadded_widths_and_c_kv_halves(segments, dv_split):
    # kv_lora 64 and rope 16 fill their blocks (no column mask); halves of 32 columns each, the
    # rope part a K = 16 dot of its own
    check("decode", torch.float32, heads=6, lora=64, rope=16, block_h=4, tile_n=16, num_segments=segments,
          dv_split=dv_split)  # fmt: skip


@pytest.mark.parametrize("reduce_cols", [16, 32])
@pytest.mark.parametrize("lora", [LORA, 64])
def test_split_kv_merge_in_column_pieces(lora, reduce_cols):
    # the merge over c_kv pieces of 16 / 32 columns (REDUCE_COLS), kv_lora 40 leaving the last
    # piece of its 64-wide block unstored; 6 heads leave two of the second head block's rows masked
    check("decode", torch.float32, heads=6, lora=lora, block_h=4, tile_n=16, num_segments=4, reduce_cols=reduce_cols)
    check("mixed", torch.float16, heads=6, lora=lora, tile_n=16, num_segments=2, reduce_cols=reduce_cols)


def test_c_kv_halves_over_a_masked_width():
    check("prefill_over_prefix", torch.float32, heads=3, dv_split=2, tile_n=16)  # kv_lora 40: halves of 32


def test_prefill_tiles_of_tokens_times_heads():
    # 16 heads x 4 tokens a 64-row prefill tile (DeepSeek-V2-Lite's 16 heads), over a cached prefix
    check("mixed", torch.float16, heads=16, tile_n=16)
    check("prefill_over_prefix", torch.float16, heads=16, tile_n=16, num_segments=2)


def test_split_kv_writes_and_reads_only_the_segments_a_sequence_used(monkeypatch):
    """Scratch starts as NaN: with 4 segments of at least one 16-key tile the 41-key context writes
    segments 0-2, and the 3-key one, which fits its first segment, writes none (its program writes
    the output and the reduce skips it); the other slots stay NaN (never written) and the output
    still matches the reference (never read)."""
    module = importlib.import_module("atomc.kernels.triton.mla_attention")
    scratch = []
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def nan_empty(*args, **kw):
        x = real_empty(*args, **kw).fill_(float("nan"))
        scratch.append(x)
        return x

    monkeypatch.setattr(module.torch, "empty", nan_empty)
    monkeypatch.setattr(module.torch, "empty_like", lambda x, **kw: nan_empty(x.shape, dtype=x.dtype))
    check("decode", torch.float32, heads=4, num_segments=4, tile_n=16)  # contexts 3, 41, 17, 64
    monkeypatch.setattr(module.torch, "empty", real_empty)
    monkeypatch.setattr(module.torch, "empty_like", real_empty_like)
    part_acc, part_m, part_l = scratch
    used = {0: 0, 1: 3, 2: 2, 3: 4}  # segments of max(cdiv(len, 64), 1) x 16 = 16 keys; 0: one fits
    for tok, n in used.items():
        for part in (part_m, part_l, part_acc):
            assert not part[tok, :, :n].isnan().any()
            assert part[tok, :, n:].isnan().all()


def test_segment_choice_fills_one_wave(monkeypatch):
    module = importlib.import_module("atomc.kernels.triton.mla_attention")
    monkeypatch.setattr(module, "_num_sms", lambda index: 132)  # an H200
    gpu = torch.device("cuda", 0)
    pick = lambda seqs, max_len: module._mla_segments(gpu, seqs, 2, max_len, 32)  # V3: 2 head blocks of 64
    assert pick(1, 4096) == 16 and pick(8, 4096) == pick(8, 16384) == 8
    assert pick(16, 4096) == 4 and pick(32, 4096) == 2 and pick(64, 4096) == pick(48, 4096) == 1
    assert pick(8, 100) == 2  # 2-tile segments: a 100-key context fills only 2
    # programs of 16 heads (V2-Lite, V3's TP-8 shard): two a streaming multiprocessor
    small = lambda seqs: module._mla_segments(gpu, seqs, 1, 16384, 64, block_h=16)
    assert small(64) == 4 and small(32) == 8 and small(8) == small(1) == 16 and small(132) == 2 and small(264) == 1


def test_one_c_kv_piece_where_16_head_programs_leave_sms_one_each(monkeypatch):
    module = importlib.import_module("atomc.kernels.triton.mla_attention")
    monkeypatch.setattr(module, "_num_sms", lambda index: 132)
    gpu = torch.device("cuda", 0)
    assert module._dv_split(gpu, 8 * 16, 16, 2) == 1  # bs 8, 16 segments: one program an SM
    assert module._dv_split(gpu, 64 * 4, 16, 2) == 2  # bs 64, 4 segments: two an SM
    assert module._dv_split(gpu, 8 * 2 * 8, 64, 2) == 2  # 64-head programs keep the tiling's
    assert module._dv_split(torch.device("cpu"), 8, 16, 2) == 2  # the interpreter: as asked


def test_default_tiles():
    tiles = importlib.import_module("atomc.kernels.triton.mla_attention").mla_tiles
    v3 = tiles(128, 512, True, 2)  # bf16 decode at V3's widths: 64 heads on two warpgroups
    assert (v3["block_h"], v3["block_m"], v3["num_warps"], v3["tile_n"], v3["dv_split"]) == (64, 64, 8, 64, 2)
    assert tiles(128, 512, False, 2)["tile_n"] == 32  # prefill keeps 32 keys a step (not swept)
    assert tiles(128, 512, False, 2)["block_q"] == 1 and tiles(16, 512, False, 2)["block_q"] == 4
    assert tiles(16, 512, True, 2)["block_m"] == 16  # V2-Lite decode: one token's 16 heads
    assert tiles(16, 512, True, 2)["num_warps"] == 8  # measured faster than 4 there
    fp32 = tiles(128, 512, True, 4)
    assert (fp32["block_h"], fp32["num_warps"], fp32["tile_n"]) == (32, 4, 16)
    old = tiles(128, 512, True, 2, block_h=32, tile_n=64, num_warps=4)  # the tiling before, by knobs
    assert (old["block_h"], old["block_m"], old["tile_n"], old["num_warps"]) == (32, 32, 64, 4)
    assert tiles(4, 16, True, 4)["dv_split"] == 1  # kv_lora 16: no halves of a dot's 16 columns
    with pytest.raises(AssertionError, match="dv_split"):
        tiles(4, 16, True, 4, dv_split=2)  # halves of 8 columns: below a dot's 16
