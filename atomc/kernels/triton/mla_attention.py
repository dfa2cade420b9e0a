"""Multi-head latent attention (DeepSeek-V2/V3, absorbed form) over the paged latent cache.

Every token caches one latent row [c_kv | k_pe] (kv_lora + rope values, e.g. 512 + 64) shared by
all H heads: the key of every head is the whole row, its value the c_kv part (atomc/ops/mla.py).
So MLA is multi-query attention with one wide head. Per latent byte read, H heads do
2 x (576 + 512) / (2 x 576) = 1.89 H FLOPs: 242 at V3's 128 heads, above an H200's ridge
(989 TFLOP/s / 4.3 TB/s = 230), so V3's decode is bound by the tensor cores at any batch
(docs/kernels.md, "MLA"; benchmarks/ceilings.py, `mla_decode_roofline`). The kernel is built for
that regime, as the fast MLA decode kernels are:

- Many query rows a program so one latent tile load feeds them all and the MMAs are full: the M
  rows of a tile are BLOCK_Q query tokens x BLOCK_H heads, heads of one token first (row m = token
  m // BLOCK_H, head m % BLOCK_H of the program's head block). A Hopper warpgroup MMA is 64 rows
  tall, so 16-bit decode takes BLOCK_H 64 heads on 8 warps (two warpgroups, each holding half of
  the [64, 512] fp32 accumulator: 128 registers a thread); the 32-head, 4-warp tiling before
  (about 16% of the tensor-core rate at bs 64 x 4k: its 32-row dots compile to mma.sync, and it
  spills) is reachable through the knobs. Triton gives a dot that feeds another dot all warps
  along M, so both warpgroups compute the same [64, TILE_N] scores: per key a warpgroup does
  64 x (576 + 256) MMA work against 64 x 544 for an even split, a ceiling of 65% of the tensor
  peak for this design (docs/kernels.md). V3's 128 heads make 2 head blocks, the fastest part of
  the program id: a token's blocks read the same latent tiles at about the same time, so the
  second read hits L2.
- Scores are tensor-core dots over the pieces of the row as stored, never a padded 576: c_kv
  (whole, or as two halves with DV_SPLIT 2) plus the rope part as its own K = 64 dot. The value
  tile is the very c_kv piece the scores used (loaded once); with DV_SPLIT 2 the accumulator is
  two [M, kv_lora / 2] halves, each fed by its half of the tile.
- Softmax in the log2 domain with the scale folded into one FMA per score (the running max is
  kept scaled, p = exp2(s * scale_log2 - m)); fp32 accumulation; decode masks keys past the
  context only (one query a sequence: its causal limit is the context end).
- Split-KV for decode at small batch (`SPLIT`): each sequence's context is cut into NUM_SEGMENTS
  pieces of whole tiles; a program whose piece is empty exits before any load; the others write
  fp32 partials (max, sum, acc), and a reduce kernel merges, for each sequence, only the segments
  its context used; a context that fits the first segment is finished by that program (no
  partials; the reduce skips it), so a short context at batch 1 pays no merge. The segment count
  aims at one wave of programs (at 64 heads a program one fits an SM), unlike the MHA decode's 4
  programs an SM.

One kernel for decode, prefill, chunked prefill over a cached prefix and mixed batches (prefill
rows pack up to 64 tokens x heads; the causal mask is on there). Prefill in this absorbed form
costs (kv_lora + rope) + kv_lora = 1088 multiply-adds a head and key pair at V3's widths, against
192 + 128 for the expanded form (per-head K/V up-projected from the latent, then ordinary
attention): long prompts would run faster expanded, at the price of materialising K/V per chunk.

No host sync in the wrapper (grid sizes from host ints; `max_seq_len` may be an upper bound), so
it is captured in CUDA graphs like the MHA kernel. The pages are written by mla_latent_write.py.

FP8 pages (`FP8`, a constexpr; `--kv-cache-dtype fp8`): the rows hold [c_kv | k_pe] / kv_scale in
e4m3, one scale a layer (atomc/ops/mla.py). The attention kernel loads e4m3 tiles and widens them exactly (to fp16 when
q is bf16, the MHA kernel's `F16_DOTS`: one instruction for two values against three for bf16; q
rounded to fp16 once a program, clamped to its range), so the dots see the stored values; since the scores
are q . (stored * kv_scale) over both pieces, kv_scale is folded into the logit scale, and since the
values are the c_kv pieces, it multiplies the accumulators once after the KV loop, before the final
store or the split-KV partials (the reduce is unchanged). Half the bytes a latent row (576 at V3's
widths), so the same memory holds twice the tokens of a bf16 cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomc.kernels.triton import pdl
from atomc.kernels.triton.mla_latent_write import latent_scale_arg
from atomc.kernels.triton.paged_attention import (
    CAPTURE_SEG_TILES,
    MAX_SEGMENTS,
    MIN_SEG_TILES,
    _block_keys,
    _find_seq,
    _num_sms,
    _seg_len,
    to_f16_clamped,
)
from atomc.kernels.triton.pdl import after_producer
from atomc.kernels.triton.split_kv_merge import merge_partials

# c_kv columns a split-KV merge program takes (0: the whole row). With the whole row, V2-Lite's 16
# heads at batch 1 leave one merge program reading every partial (16 segments x 16 heads x 512
# fp32, 512 KiB); 32 columns spread that over sixteen. The fastest of 0 / 32 / 64 / 128 in 7 of 8
# cells on an H100 (decode_attention_short.py --merge, V2-Lite and V3 at bs 1 / 8, ctx 256 / 2k):
# V2-Lite bs 1 ctx 2k 13.3 against 18.2 us a call with its merge (docs/performance.md section 20).
REDUCE_COLS = 32


@triton.jit
def _rows(ptr, rows, row_ok, COL0: tl.constexpr, COLS: tl.constexpr, LIMIT: tl.constexpr, FULL: tl.constexpr):
    """[len(rows), COLS] of ptr + rows + COL0 + j; rows not row_ok and columns COL0 + j >= LIMIT
    read 0 (FULL: no column is past LIMIT, so only the row mask is applied)."""
    offs = COL0 + tl.arange(0, COLS)
    ptrs = ptr + rows[:, None] + offs[None, :]
    if FULL:
        return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    return tl.load(ptrs, mask=row_ok[:, None] & (offs < LIMIT)[None, :], other=0.0)


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _mla_kernel(
    qc_ptr, qr_ptr, cache_ptr, out_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, kv_scale_ptr,
    qk_scale, num_seqs,
    stride_qct, stride_qch, stride_qrt, stride_qrh,
    stride_cb, stride_cs,
    stride_ot, stride_oh,
    stride_bt,
    KV_LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, PAGE: tl.constexpr, NUM_SEGMENTS: tl.constexpr, SPLIT: tl.constexpr,
    MIN_SEG_TILES: tl.constexpr, DV_SPLIT: tl.constexpr, DECODE: tl.constexpr, PRECISION: tl.constexpr,
    FP8: tl.constexpr, F16_DOTS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    after_producer(PDL)  # pdl.py
    # head blocks fastest: a token's run side by side (see the module docstring); one axis for
    # both, as a y axis would cap the q blocks at 65535
    head_block = tl.program_id(0) % HEAD_BLOCKS
    q_block = tl.program_id(0) // HEAD_BLOCKS
    seg = tl.program_id(1)

    seq = _find_seq(q_block, query_start_loc_ptr, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len  # cached tokens before this step's queries

    _, kv_end = _block_keys(seq_len, prefix, q_block_local, BLOCK_Q, TILE_N, 0)  # keys the block can see
    kv_begin = 0
    alone = True  # this program sees all of the block's keys: it writes the output itself
    if SPLIT:
        seg_len = _seg_len(seq_len, 0, NUM_SEGMENTS, TILE_N, MIN_SEG_TILES)  # the MHA decode's segments
        alone = kv_end <= seg_len  # (a padding sequence with no keys too: it writes zeros)
        if alone:
            if seg > 0:
                return
        else:
            kv_begin = seg * seg_len
            kv_end = tl.minimum(kv_end, kv_begin + seg_len)
            if kv_begin >= kv_end:  # past this block's keys: the reduce reads no partial from here
                return

    CHUNK: tl.constexpr = BLOCK_C // DV_SPLIT  # c_kv columns a piece (a power of two)
    FULL_C: tl.constexpr = KV_LORA == BLOCK_C
    FULL_R: tl.constexpr = ROPE == BLOCK_R
    offs_m = tl.arange(0, BLOCK_M)
    q_local = q_block_local * BLOCK_Q + offs_m // BLOCK_H
    head = head_block * BLOCK_H + offs_m % BLOCK_H
    row_ok = (q_local < q_len) & (head < NUM_HEADS)
    q_pos = prefix + q_local  # causal: key n is visible iff n <= q_pos
    tok = (q_start + q_local).to(tl.int64)
    q_rows = tok * stride_qct + head * stride_qch
    qa = _rows(qc_ptr, q_rows, row_ok, 0, CHUNK, KV_LORA, FULL_C)
    if DV_SPLIT == 2:
        qb = _rows(qc_ptr, q_rows, row_ok, CHUNK, CHUNK, KV_LORA, FULL_C)
    qr = _rows(qr_ptr, tok * stride_qrt + head * stride_qrh, row_ok, 0, BLOCK_R, ROPE, FULL_R)
    if FP8:
        qk_scale = qk_scale * tl.load(kv_scale_ptr)  # s = q . (stored * kv_scale), c_kv and k_pe alike
        if F16_DOTS:
            qa = to_f16_clamped(qa)
            if DV_SPLIT == 2:
                qb = to_f16_clamped(qb)
            qr = to_f16_clamped(qr)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, scaled (log2 domain)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_a = tl.zeros([BLOCK_M, CHUNK], tl.float32)
    if DV_SPLIT == 2:
        acc_b = tl.zeros([BLOCK_M, CHUNK], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, TILE_N)
    for start in range(kv_begin, kv_end, TILE_N):
        n = start + offs_n
        n_ok = n < kv_end
        page = tl.load(bt_row + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        row = page * stride_cb + (n % PAGE) * stride_cs
        ka = _rows(cache_ptr, row, n_ok, 0, CHUNK, KV_LORA, FULL_C)
        if FP8:
            ka = ka.to(qa.dtype)  # e4m3 widens exactly
        s = tl.dot(qa, tl.trans(ka), input_precision=PRECISION)
        if DV_SPLIT == 2:
            kb = _rows(cache_ptr, row, n_ok, CHUNK, CHUNK, KV_LORA, FULL_C)
            if FP8:
                kb = kb.to(qb.dtype)
            s = tl.dot(qb, tl.trans(kb), s, input_precision=PRECISION)
        kr = _rows(cache_ptr + KV_LORA, row, n_ok, 0, BLOCK_R, ROPE, FULL_R)
        if FP8:
            kr = kr.to(qr.dtype)
        s = tl.dot(qr, tl.trans(kr), s, input_precision=PRECISION)
        if DECODE:
            visible = n_ok[None, :]  # the one query of a sequence sees its whole context
        else:
            visible = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked row: no inf - inf
        p = tl.exp2(s * qk_scale - m_safe[:, None])  # qk_scale = scale * log2(e): one FMA a score
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(ka.dtype)
        acc_a = tl.dot(p, ka, acc_a * alpha[:, None], input_precision=PRECISION)
        if DV_SPLIT == 2:
            acc_b = tl.dot(p, kb, acc_b * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    if FP8:
        v_scale = tl.load(kv_scale_ptr)  # the values are the stored c_kv * kv_scale
        acc_a = acc_a * v_scale
        if DV_SPLIT == 2:
            acc_b = acc_b * v_scale
    offs_a = tl.arange(0, CHUNK)
    if not alone:
        # scratch [T, H, NUM_SEGMENTS(, BLOCK_C)], unnormalised
        idx = (tok * NUM_HEADS + head) * NUM_SEGMENTS + seg
        tl.store(part_m_ptr + idx, m_i, mask=row_ok)
        tl.store(part_l_ptr + idx, l_i, mask=row_ok)
        acc_rows = part_acc_ptr + idx[:, None] * BLOCK_C
        tl.store(acc_rows + offs_a[None, :], acc_a, mask=row_ok[:, None])
        if DV_SPLIT == 2:
            tl.store(acc_rows + CHUNK + offs_a[None, :], acc_b, mask=row_ok[:, None])
    else:
        l_safe = tl.where(l_i > 0, l_i, 1.0)  # a row with no keys writes zeros, not NaN
        out_rows = out_ptr + (tok * stride_ot + head * stride_oh)[:, None]
        tl.store(
            out_rows + offs_a[None, :], (acc_a / l_safe[:, None]).to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & (offs_a < KV_LORA)[None, :],
        )  # fmt: skip
        if DV_SPLIT == 2:
            tl.store(
                out_rows + CHUNK + offs_a[None, :], (acc_b / l_safe[:, None]).to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None] & (CHUNK + offs_a < KV_LORA)[None, :],
            )  # fmt: skip


@triton.jit(do_not_specialize=["num_seqs"])
def _mla_reduce_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, query_start_loc_ptr, seq_lens_ptr, num_seqs,
    stride_ot, stride_oh,
    KV_LORA: tl.constexpr, BLOCK_C: tl.constexpr, NUM_HEADS: tl.constexpr, RED_H: tl.constexpr,
    RED_HEAD_BLOCKS: tl.constexpr, RED_M: tl.constexpr, RED_C: tl.constexpr, BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr, NUM_SEGMENTS: tl.constexpr, MIN_SEG_TILES: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    after_producer(PDL)  # pdl.py
    # the attention kernel's q-block mapping (same BLOCK_Q), its own head blocks (RED_H heads: the
    # merge holds [RED_M, RED_C] fp32, small enough for 4 warps), so only owned rows are written;
    # axis 1 cuts the c_kv columns into BLOCK_C / RED_C pieces (every piece weighs the segments alike)
    head_block = tl.program_id(0) % RED_HEAD_BLOCKS
    q_block = tl.program_id(0) // RED_HEAD_BLOCKS
    seq = _find_seq(q_block, query_start_loc_ptr, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    _, kv_end = _block_keys(seq_len, seq_len - q_len, q_block_local, BLOCK_Q, TILE_N, 0)
    # the segments the attention kernel wrote for this q block (the rest exited without a store)
    used = tl.cdiv(kv_end, _seg_len(seq_len, 0, NUM_SEGMENTS, TILE_N, MIN_SEG_TILES))
    if used <= 1:  # the block's keys fit one segment: the attention kernel wrote its output
        return

    offs_m = tl.arange(0, RED_M)
    q_local = q_block_local * BLOCK_Q + offs_m // RED_H
    head = head_block * RED_H + offs_m % RED_H
    row_ok = (q_local < q_len) & (head < NUM_HEADS)
    tok = (q_start + q_local).to(tl.int64)
    # this program's c_kv piece of each row; no sinks (part_m_ptr fills the unread sinks argument)
    merge_partials(
        out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, part_m_ptr, tok, head, row_ok, used, stride_ot, stride_oh,
        tl.program_id(1) * RED_C, KV_LORA, RED_M, RED_C, BLOCK_C, NUM_HEADS, NUM_SEGMENTS, False,
    )  # fmt: skip


def _mla_segments(
    device: torch.device, num_seqs: int, head_blocks: int, max_seq_len: int, tile_n: int, block_h: int = 64
) -> int:
    """Split-KV segment count for decode: the most (a power of two, at most MAX_SEGMENTS) that
    keeps the programs within one wave, one a streaming multiprocessor (a 64-head program's
    accumulator and tiles take an SM's registers and most of its shared memory; programs of 16
    heads or fewer, two a streaming multiprocessor: at V3's TP-8 shard, bs 64, an H100 ran 4
    segments in 122 / 414 us against 2 segments' 168 / 604 at ctx 4k / 16k), and no more than
    `max_seq_len` fills with CAPTURE_SEG_TILES-tile segments; at run time a short context uses the
    first few, one tile each (as the MHA decode). V3 on 132 SMs: bs 1 -> 16, bs 8 -> 8, bs 32 -> 2,
    bs 64 -> 1 (128 programs); V2-Lite (16 heads) at bs 1 in a graph captured for 8k tokens: 16
    segments of 2 tiles at ctx 2k, 19.5 us (benchmarks/decode_attention_short.py)."""
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 8
    programs = num_seqs * head_blocks
    fit = (2 if block_h <= 16 else 1) * sms // programs
    if fit < 2:
        return 1
    want = 1 << (fit.bit_length() - 1)  # largest power of two <= fit
    most = triton.next_power_of_2(max(1, triton.cdiv(max_seq_len, CAPTURE_SEG_TILES * tile_n)))
    return max(1, min(want, most, MAX_SEGMENTS))


def _dv_split(device: torch.device, programs: int, block_h: int, default: int) -> int:
    """c_kv pieces for a 16-bit decode launch: one piece where programs of 16 heads or fewer leave
    the SMs one each, else the tiling's (two). On an H100 at 16 heads (performance.md section 28),
    one piece: bs 8 (128 programs) 29.7 / 82.3 us against 32.1 / 92.0 at ctx 4k / 16k, bs 1 equal;
    at bs 64 (256 programs, two an SM) 152.8 / 570.6 against 122.3 / 414.4."""
    if device.type != "cuda":
        return default  # the interpreter's tests keep the tiling they ask for
    return 1 if block_h <= 16 and programs <= _num_sms(device.index or 0) else default


def mla_tiles(
    num_heads: int, kv_lora: int, decode: bool, element_size: int,
    block_h: int | None = None, tile_n: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, dv_split: int | None = None,
) -> dict:  # fmt: skip
    """The tiling mla_attention launches with: the given knobs, the defaults for the rest.
    16-bit: 64 heads (prefill: 64 rows of tokens x heads) a program, 64 keys a step (prefill 32), 8 warps, 2
    stages, c_kv as two halves (compiled for sm_90 with Triton 3.9: 144 KiB of shared memory, 255
    registers and 16 bytes of spill a thread, against 56 bytes with one piece); fp32 (tests, tiny
    models) keeps the smaller 32-head / 16-key tiles its shared memory allows."""
    half = element_size <= 2
    if block_h is None:
        block_h = 64 if half else 32
    block_h = min(triton.next_power_of_2(num_heads), triton.next_power_of_2(block_h))
    # decode: one token a program (at least 16 rows for tl.dot); prefill: tokens x heads up to
    # one warpgroup MMA's 64 rows (fp32: 32, what its accumulator leaves registers for)
    block_m = max(16, block_h) if decode else max(64 if half else 32, block_h)
    block_c = max(16, triton.next_power_of_2(kv_lora))
    if tile_n is None:
        # decode: 64 keys a step (a [64, 576] bf16 latent tile, 72 KiB a stage, 2 stages beside the
        # 72 KiB of a 64-head query): the fastest of benchmarks/mla_decode.py --sweep on the H200 at
        # bs 8 / 64 x 4k / 16k (1.2-1.4x the 32-key step); prefill keeps 32 (not swept)
        tile_n = (64 if decode else 32) if half else 16
    if num_warps is None:
        # <= 128 accumulator floats a thread: [64, 512] fp32 over two warpgroups
        # (16-bit decode at 16 heads too: 8 warps measured 5-10% faster than 4 at V2-Lite's widths)
        num_warps = 8 if (half and decode) or block_m * block_c >= (64 if decode else 16) * 512 else 4
    if dv_split is None:
        dv_split = 2 if block_c >= 32 else 1
    assert dv_split in (1, 2) and block_c % (16 * dv_split) == 0, f"dv_split {dv_split} over kv_lora {kv_lora}"
    return dict(
        block_h=block_h, block_m=block_m, block_q=block_m // block_h, block_c=block_c, tile_n=tile_n,
        num_warps=num_warps, num_stages=2 if num_stages is None else num_stages, dv_split=dv_split,
    )  # fmt: skip


def mla_attention(
    q_absorbed: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    num_seqs: int,
    *,
    num_segments: int | None = None,
    block_h: int | None = None,
    tile_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    dv_split: int | None = None,
    min_seg_tiles: int = MIN_SEG_TILES,
    kv_scale: torch.Tensor | None = None,
    reduce_cols: int | None = None,
) -> torch.Tensor:
    """Causal latent attention of q_absorbed [T, H, kv_lora] and q_pe [T, H, rope] over the latent
    pages [blocks, page, 1, kv_lora + rope]; writes out [T, H, kv_lora].

    Sequence i's queries are rows query_start_loc[i]:query_start_loc[i+1], the last q_len of its
    seq_lens[i] positions; rows no sequence owns are left untouched. `num_segments` forces split-KV
    (> 1) or not (1); by default decode batches too small to fill the GPU are split. `block_h`
    (heads a tile, a power of two), `tile_n` (keys a step, >= 16), `num_warps`, `num_stages`,
    `dv_split` (1: c_kv as one piece; 2: two halves, two accumulators), `min_seg_tiles` (the fewest
    tiles a split-KV segment takes), `reduce_cols` (c_kv columns a merge program; default
    REDUCE_COLS): tuning knobs for benchmarks (`mla_tiles`).
    `kv_scale` fp32 [1]: the pages are FP8 (e4m3) and hold the latent / kv_scale."""
    num_tokens, num_heads, kv_lora = q_absorbed.shape
    _, page, one, latent_dim = latent_cache.shape
    rope = latent_dim - kv_lora
    assert one == 1 and rope > 0, f"latent pages {tuple(latent_cache.shape)} do not fit kv_lora {kv_lora}"
    assert q_pe.shape == (num_tokens, num_heads, rope) and out.shape[1:] == (num_heads, kv_lora)
    assert q_absorbed.stride(-1) == 1 and q_pe.stride(-1) == 1 and out.stride(-1) == 1
    assert latent_cache.stride(-1) == 1
    if num_seqs == 0 or num_tokens == 0:
        return out
    kv_scale, fp8 = latent_scale_arg(latent_cache, kv_scale, out)
    decode = max_query_len == 1
    # the tiles are sized for the dots' operand width: FP8 tiles widen to the query's dtype
    t = mla_tiles(
        num_heads, kv_lora, decode, q_absorbed.element_size() if fp8 else latent_cache.element_size(),
        block_h, tile_n, num_warps, num_stages, dv_split,
    )  # fmt: skip
    block_h, block_q, block_c, tile_n = t["block_h"], t["block_q"], t["block_c"], t["tile_n"]
    head_blocks = triton.cdiv(num_heads, block_h)
    block_r = max(16, triton.next_power_of_2(rope))
    q_blocks = num_tokens // block_q + num_seqs  # upper bound (see _find_seq); spare programs exit

    if num_segments is None:
        num_segments = (
            _mla_segments(q_absorbed.device, num_seqs, head_blocks, max_seq_len, tile_n, block_h) if decode else 1
        )
    num_segments = triton.next_power_of_2(num_segments)
    dv = (
        t["dv_split"]
        if dv_split is not None or fp8 or not decode or q_absorbed.element_size() > 2
        else _dv_split(q_absorbed.device, num_seqs * head_blocks * num_segments, block_h, t["dv_split"])
    )
    split = num_segments > 1
    if split:
        # only the segments a sequence's context reaches are written, and only those are read
        dev = q_absorbed.device
        part_acc = torch.empty(num_tokens, num_heads, num_segments, block_c, dtype=torch.float32, device=dev)
        part_m = torch.empty(num_tokens, num_heads, num_segments, dtype=torch.float32, device=dev)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused

    _mla_kernel[(head_blocks * q_blocks, num_segments)](
        q_absorbed, q_pe, latent_cache, out,
        part_acc, part_m, part_l,
        query_start_loc, seq_lens, block_tables, kv_scale,
        scale * 1.4426950408889634, num_seqs,
        q_absorbed.stride(0), q_absorbed.stride(1), q_pe.stride(0), q_pe.stride(1),
        latent_cache.stride(0), latent_cache.stride(1),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        KV_LORA=kv_lora, ROPE=rope, BLOCK_C=block_c, BLOCK_R=block_r, NUM_HEADS=num_heads, BLOCK_H=block_h,
        HEAD_BLOCKS=head_blocks, BLOCK_M=t["block_m"], BLOCK_Q=block_q, TILE_N=tile_n, PAGE=page,
        NUM_SEGMENTS=num_segments, SPLIT=split, MIN_SEG_TILES=min_seg_tiles, DV_SPLIT=dv,
        DECODE=decode, PRECISION="ieee" if q_absorbed.dtype == torch.float32 else "tf32", FP8=fp8,
        F16_DOTS=fp8 and q_absorbed.dtype == torch.bfloat16, num_warps=t["num_warps"], num_stages=t["num_stages"],
        **pdl.launch(q_absorbed),
    )  # fmt: skip
    if split:
        red_h = max(1, min(block_h, 16 // block_q))  # about 16 rows a merge program
        red_m = block_q * red_h
        red_head_blocks = triton.cdiv(num_heads, red_h)
        red_c = reduce_cols if reduce_cols is not None else REDUCE_COLS
        red_c = block_c if red_c <= 0 else min(block_c, max(16, triton.next_power_of_2(red_c)))
        _mla_reduce_kernel[(red_head_blocks * q_blocks, block_c // red_c)](
            out, part_acc, part_m, part_l, query_start_loc, seq_lens, num_seqs,
            out.stride(0), out.stride(1),
            KV_LORA=kv_lora, BLOCK_C=block_c, NUM_HEADS=num_heads, RED_H=red_h, RED_HEAD_BLOCKS=red_head_blocks,
            RED_M=red_m, RED_C=red_c, BLOCK_Q=block_q, TILE_N=tile_n, NUM_SEGMENTS=num_segments,
            MIN_SEG_TILES=min_seg_tiles, num_warps=4 if red_m * red_c <= 16 * 512 else 8, **pdl.launch(q_absorbed),
        )  # fmt: skip
    return out
