"""Paged attention over NHD pages for any mix of prefill, chunked prefill and decode.

One kernel, two launch shapes:
- 2D: grid (q_blocks, kv_heads); each program owns BLOCK_Q query tokens x the GQA group of one KV
  head (packed into the M rows of the tile) and walks the whole causal KV range.
- split-KV ("3D"): grid (q_blocks, kv_heads, segments); each sequence's KV range is cut into
  `segments` equal pieces, partial (max, sum, acc) go to fp32 scratch and a reduce kernel merges
  them. Used for decode at small batch, where 2D would leave most SMs idle. With MERGE_LAST (for
  batches of at most MERGE_IN_KERNEL_MAX_SEQS sequences; off until timed) the last segment
  program of a q block to finish merges instead (an atomic arrival counter), and the reduce
  kernel is not launched. Segments are at least
  MIN_SEG_TILES tiles, so a short context fills only the first few, and a context that fits the
  first is finished by its program as in 2D (the reduce skips it): at batch 1 with a short
  context, the split costs no partials and no merge.

The wrapper does no host sync (no .item()/.tolist()), so it can be captured in a CUDA graph;
grid sizes come from host ints, and `max_seq_len` may be an upper bound (segment lengths are
derived per sequence from seq_lens on device, so extra segments just see no keys).

Sliding window (`WINDOW` > 0, a constexpr): a program starts at the first KV tile that holds a key
inside its queries' window, so the keys before the window cost nothing, and masks only inside the
boundary tile; split-KV cuts only the window's span into segments. With WINDOW = 0 the kernel is the
full-attention kernel (the window code is not compiled in).

Attention sinks (`SINKS`, a constexpr; GPT-OSS): one logit per query head joins the softmax
denominator. It is folded in once, after the KV loop (2D) or in the reduce (split-KV), as one more
"key" with no value: the running max becomes max(m, sink) and the sum gains exp(sink - max). With
SINKS off (every dense family) the sink code is not compiled in and the kernel is the old one.

FP8 pages (`FP8`, a constexpr; `--kv-cache-dtype fp8`): K and V tiles load as e4m3 and widen
exactly (every e4m3 value is an fp16 and a bf16 value), so the dots see the stored values; the
layer's k_scale is folded into the logit scale and its v_scale into the accumulator once, after the
KV loop, before either the final store or the split-KV partials (the reduce is the same kernel).
With bf16 queries the dots run in fp16 (`F16_DOTS`): e4m3 -> fp16 is one packed instruction for two
values (`cvt.rn.f16x2.e4m3x2`), e4m3 -> bf16 three, and in the decode loop, where every loaded byte
is converted, the bf16 widening made the FP8 kernel 1.5x slower than bf16 pages on the H200. q is
rounded to fp16 once a program (clamped to fp16's range; bf16's 8 mantissa bits fit in fp16's 11)
and P to fp16 for the PV dot (more mantissa than bf16 for probabilities in [0, 1]).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from atomc.kernels.triton import arrivals, pdl
from atomc.kernels.triton.arrivals import arrive, reset
from atomc.kernels.triton.kv_cache_write import kv_scale_args
from atomc.kernels.triton.pdl import after_producer
from atomc.kernels.triton.split_kv_merge import fold_sink, merge_partials


@triton.jit
def _find_seq(q_block, query_start_loc_ptr, num_seqs, BLOCK_Q: tl.constexpr):
    # sequence i owns q blocks [qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1): an upper bound
    # that never undercounts; binary search for the last i whose first block <= q_block
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Triton compiles a variant per value class of each int argument (== 1, a multiple of 16, other).
# num_seqs and the block-table width change from step to step, so left specialized they would
# compile new variants while serving (seconds each, on a request's critical path); neither feeds
# vectorized addressing, so specializing them buys nothing.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr, counter_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale, num_seqs,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr, NUM_Q_HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    PAGE: tl.constexpr, NUM_SEGMENTS: tl.constexpr, SPLIT: tl.constexpr,
    MIN_SEG_TILES: tl.constexpr, IEEE: tl.constexpr, WINDOW: tl.constexpr, SINKS: tl.constexpr,
    FP8: tl.constexpr, F16_DOTS: tl.constexpr, MERGE_LAST: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seg = tl.program_id(2)
    after_producer(PDL)  # pdl.py: q, the cache and the step's metadata are all written in the step

    seq = _find_seq(q_block, query_start_loc_ptr, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len  # cached tokens before this step's queries

    # row m of the tile = query token m // GROUP, head kv_head * GROUP + m % GROUP
    offs_m = tl.arange(0, BLOCK_M)
    q_local = q_block_local * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_local < q_len)
    q_pos = prefix + q_local  # absolute position; causal: key n visible iff n <= q_pos
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q_rows = (q_start + q_local).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)  # s = q . (stored * k_scale) * scale
        if F16_DOTS:
            q = to_f16_clamped(q)

    kv_lo, kv_end = _block_keys(seq_len, prefix, q_block_local, BLOCK_Q, TILE_N, WINDOW)
    kv_begin = kv_lo
    alone = True  # this program sees all of the block's keys: it writes the output itself
    used = 1  # the segments holding keys (split-KV: the programs that write partials)
    if SPLIT:
        seg_len = _seg_len(seq_len, kv_lo, NUM_SEGMENTS, TILE_N, MIN_SEG_TILES)
        used = tl.cdiv(kv_end - kv_lo, seg_len)
        alone = kv_end - kv_lo <= seg_len  # (a padding sequence with no keys too: it writes zeros)
        if alone:
            if seg > 0:
                return
        else:
            kv_begin = kv_lo + seg * seg_len
            if kv_begin >= kv_end:  # past the block's keys: the reduce reads no partial from here
                return
            kv_end = tl.minimum(kv_end, kv_begin + seg_len)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, TILE_N)
    for start in range(kv_begin, kv_end, TILE_N):
        n = start + offs_n
        n_ok = n < kv_end
        page = tl.load(bt_row + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        slot_in_page = n % PAGE
        k_off = page * stride_kb + slot_in_page * stride_ks + kv_head * stride_kh
        v_off = page * stride_vb + slot_in_page * stride_vs + kv_head * stride_vh
        kt = tl.load(k_cache_ptr + k_off[None, :] + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if FP8:
            kt = kt.to(q.dtype)
            v = v.to(q.dtype)

        if IEEE:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s = s * qk_scale  # log2 domain: qk_scale = scale * log2(e)
        visible = row_ok[:, None] & n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            visible = visible & (n[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked row: avoid inf - inf
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if FP8:
        acc = acc * tl.load(v_scale_ptr)  # sum p * (stored * v_scale)
    tok = (q_start + q_local).to(tl.int64)
    if not alone:
        # scratch [T, Hq, NUM_SEGMENTS(, BLOCK_D)], unnormalized
        idx = (tok * NUM_Q_HEADS + head) * NUM_SEGMENTS + seg
        tl.store(part_m_ptr + idx, m_i, mask=row_ok)
        tl.store(part_l_ptr + idx, l_i, mask=row_ok)
        tl.store(part_acc_ptr + idx[:, None] * BLOCK_D + offs_d[None, :], acc, mask=row_ok[:, None])
        if MERGE_LAST:
            # the block's last segment program to arrive merges (arrivals.py)
            counter = counter_ptr + q_block * tl.num_programs(1) + kv_head
            if arrive(counter) == used - 1:
                reset(counter)
                merge_partials(
                    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, sinks_ptr, tok, head, row_ok, used,
                    stride_ot, stride_oh, 0, HEAD_DIM, BLOCK_M, BLOCK_D, BLOCK_D, NUM_Q_HEADS, NUM_SEGMENTS, SINKS,
                )  # fmt: skip
    else:
        if SINKS:
            m_i, l_i, acc = fold_sink(sinks_ptr, head, m_i, l_i, acc)
        l_safe = tl.where(l_i > 0, l_i, 1.0)  # a row with no keys writes zeros, not NaN
        o = acc / l_safe[:, None]
        o_rows = tok * stride_ot + head * stride_oh
        tl.store(
            out_ptr + o_rows[:, None] + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )


@triton.jit
def to_f16_clamped(x):
    """x rounded to fp16 for the dots over FP8 pages (F16_DOTS), clamped to fp16's range, not inf."""
    return tl.clamp(x.to(tl.float32), -65504.0, 65504.0).to(tl.float16)


@triton.jit
def _block_keys(seq_len, prefix, q_block_local, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, WINDOW: tl.constexpr):
    """[kv_lo, kv_end): the keys a q block can see at all (the reduce recomputes them the same way).
    kv_lo is 0, or with a window the tile of the key the block's first query sees first (its
    position - WINDOW + 1)."""
    kv_end = tl.minimum(seq_len, prefix + (q_block_local + 1) * BLOCK_Q)
    kv_lo = 0
    if WINDOW > 0:
        kv_lo = tl.maximum(prefix + q_block_local * BLOCK_Q - (WINDOW - 1), 0) // TILE_N * TILE_N
    return kv_lo, kv_end


@triton.jit
def _seg_len(seq_len, kv_lo, NUM_SEGMENTS: tl.constexpr, TILE_N: tl.constexpr, MIN_SEG_TILES: tl.constexpr):
    # a sequence's segment length over [kv_lo, seq_len): a multiple of TILE_N so every segment
    # count is valid, and at least MIN_SEG_TILES tiles, so a short context leaves the last segments
    # empty rather than one tile a program; the reduce recomputes it the same way
    return tl.maximum(tl.cdiv(seq_len - kv_lo, NUM_SEGMENTS * TILE_N), MIN_SEG_TILES) * TILE_N


@triton.jit(do_not_specialize=["num_seqs"])
def _reduce_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, query_start_loc_ptr, seq_lens_ptr, sinks_ptr, num_seqs,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr, NUM_Q_HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, NUM_SEGMENTS: tl.constexpr, SINKS: tl.constexpr,
    TILE_N: tl.constexpr, MIN_SEG_TILES: tl.constexpr, WINDOW: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # same q-block mapping as the attention kernel, so only rows owned by a sequence are written
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    after_producer(PDL)
    seq = _find_seq(q_block, query_start_loc_ptr, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= q_len:
        return
    # the segments the attention kernel wrote partials for (the same arithmetic as there); a block
    # whose keys fit one segment was written by the attention kernel itself
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_lo, kv_end = _block_keys(seq_len, seq_len - q_len, q_block_local, BLOCK_Q, TILE_N, WINDOW)
    seg_len = _seg_len(seq_len, kv_lo, NUM_SEGMENTS, TILE_N, MIN_SEG_TILES)
    if kv_end - kv_lo <= seg_len:
        return
    used = tl.cdiv(kv_end - kv_lo, seg_len)
    offs_m = tl.arange(0, BLOCK_M)
    q_local = q_block_local * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_local < q_len)
    tok = (q_start + q_local).to(tl.int64)
    merge_partials(
        out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, sinks_ptr, tok, head, row_ok, used, stride_ot, stride_oh, 0,
        HEAD_DIM, BLOCK_M, BLOCK_D, BLOCK_D, NUM_Q_HEADS, NUM_SEGMENTS, SINKS,
    )  # fmt: skip


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# The in-kernel merge for split-KV decode of at most this many sequences: faster than the reduce
# kernel in every cell timed (H100, decode_attention_short.py --merge, a graph of 32 layers; Llama's
# GQA: bs 1 ctx 256 6.8 against 7.5 us, ctx 2k 13.45 against 13.97; bs 8 10.85 / 31.73 against
# 11.13 / 32.53; Qwen3-30B-A3B's likewise; docs/performance.md section 20). An earlier version that
# merged at every batch size slowed bs 8 x 4k's main loop; the constexpr keeps it out of larger
# batches, which were not timed.
MERGE_IN_KERNEL_MAX_SEQS = 8

MIN_SEG_TILES = 1  # the fewest tiles a split-KV segment takes at run time (a sequence's own length)
CAPTURE_SEG_TILES = 2  # the fewest a segment takes at the capture bound, when the count is chosen
MAX_SEGMENTS = 16


def _pick_segments(device: torch.device, num_seqs: int, num_kv_heads: int, max_seq_len: int, tile_n: int) -> int:
    """Split-KV segment count for decode: the most (a power of two, at most MAX_SEGMENTS) that
    keeps about 4 programs per SM, and no more than `max_seq_len` fills with CAPTURE_SEG_TILES-tile
    segments. At run time a sequence's segments are cdiv(its tiles, count) tiles, at least
    MIN_SEG_TILES, so a short context uses the first few, one tile each.
    H200 sweeps (64-key tiles): bs 8 at ctx 4k and 16k was fastest with 8 segments (512 programs on
    132 SMs; 16 segments cost 14% more at 4k), bs 1 at ctx 1k with 8 segments of 2 tiles;
    benchmarks/decode_attention_short.py, bs 1 in a graph captured for 1k / 8k tokens: 4 one-tile
    segments at ctx 256 (7.5 us against 9.9 for 2 of 2 tiles), 16 of 2 tiles at ctx 2k (14.0 us
    against 15.9 for 32 of 1)."""
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 8
    programs = num_seqs * num_kv_heads
    if programs >= 2 * sms:
        return 1
    fit = max(1, 4 * sms // programs)
    want = 1 << (fit.bit_length() - 1)  # largest power of two <= fit
    most = triton.next_power_of_2(max(1, triton.cdiv(max_seq_len, CAPTURE_SEG_TILES * tile_n)))
    return max(1, min(want, most, MAX_SEGMENTS))


def default_tile_n(decode: bool, fp8: bool) -> int:
    """KV tokens an inner step reads. 64 (H200: 64 beat 32 for decode too, bs 8-64, ctx 1k-16k); 128
    for decode over FP8 pages, the bytes of a 64-key bf16 tile. H100, Llama-3.1-8B's heads, in CUDA
    graphs (benchmarks/kernels_bench.py --kv-fp8 --sweep): bs 64 / ctx 1,536 97.8 us at 128 keys and
    4 warps against 119.5 at 64 keys and 8 warps, bs 128 178.2 against 232.9, bs 8 / ctx 4,096 40.7
    against 49.6."""
    return 128 if decode and fp8 else 64


def default_num_warps(block_m: int, block_d: int, tile_n: int, fp8: bool) -> int:
    """8 warps for a 64x128 fp32 accumulator plus the S tile (it spills less over 8, sm_90 ptxas),
    and for FP8 pages at 64-key tiles (prefill), where 4 warps hold the widened K and V operands in
    186 registers a thread against 103 at 8 (benchmarks/attention_compile_check.py). FP8 decode's
    128-key tiles take 4 warps although they then hold 255 registers and spill 24 bytes: in the H100
    sweep of `default_tile_n` they ran in 97.8 us against 108.4 at 8 warps (157 registers), so the
    register count is not what limits this kernel."""
    if block_m * block_d >= 64 * 128:
        return 8
    return 8 if fp8 and tile_n < 128 else 4


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
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
    tile_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    min_seg_tiles: int = MIN_SEG_TILES,
    sliding_window: int = 0,
    sinks: torch.Tensor | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    fp8_f16_dots: bool | None = None,
    merge_in_kernel: bool | None = None,
) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over paged K/V [blocks, page, Hkv, D]; writes out [T, Hq, D].
    `sliding_window` W > 0: a query at position p sees keys p - W + 1 .. p only. `sinks` [Hq]: one
    sink logit per query head in every softmax denominator (None: none). `kv_scales` (k_scale,
    v_scale) fp32 [1]: the pages are FP8 (e4m3) and hold K / k_scale, V / v_scale.

    Sequence i's queries are rows query_start_loc[i]:query_start_loc[i+1], the last q_len of its
    seq_lens[i] positions. Rows not owned by any sequence are left untouched. `num_segments`
    forces the split-KV path (>1) or the 2D path (1); by default split-KV is used for decode
    batches too small to fill the GPU; a q block whose keys fit one segment is written by its one
    program, with no partials and no merge. `tile_n`/`num_warps`/`num_stages`/`min_seg_tiles` are
    tuning knobs for benchmarks (KV tokens per inner step, a power of two >= 16; the fewest tiles a
    split-KV segment takes); `fp8_f16_dots` over FP8 pages: None (default) fp16 dots for bf16 q,
    False the query's dtype (the benchmark's A/B of the module docstring's choice), True fp16 dots
    whatever q is (the interpreter tests, which cannot run bf16). `merge_in_kernel` (split-KV):
    the last segment program of a q block merges the partials (an arrival counter), no reduce
    kernel; None: for at most MERGE_IN_KERNEL_MAX_SEQS sequences.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    assert num_q_heads % num_kv_heads == 0 and q.stride(-1) == 1 and out.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert sinks is None or (sinks.shape == (num_q_heads,) and sinks.is_contiguous())
    k_scale, v_scale, fp8 = kv_scale_args(k_cache, kv_scales, out)
    f16_dots = fp8 and (q.dtype == torch.bfloat16 if fp8_f16_dots is None else fp8_f16_dots)
    if num_seqs == 0 or num_tokens == 0:
        return out
    group = num_q_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    # decode: one token per sequence, so the M tile is just the GQA group (min 16 for tl.dot);
    # prefill: more query tokens per tile for compute reuse of each K/V tile
    block_m = max(16 if max_query_len == 1 else 64, triton.next_power_of_2(group))
    block_q = block_m // group
    if tile_n is None:
        tile_n = default_tile_n(max_query_len == 1, fp8)
    if num_warps is None:
        num_warps = default_num_warps(block_m, block_d, tile_n, fp8)
    # upper bound on q blocks (see _find_seq); empty programs exit at once
    q_blocks = num_tokens // block_q + num_seqs

    if num_segments is None:
        num_segments = 1
        if max_query_len == 1:
            # a decode query reads at most the window (plus the alignment of its first tile)
            span = min(max_seq_len, sliding_window + tile_n) if sliding_window > 0 else max_seq_len
            num_segments = _pick_segments(q.device, num_seqs, num_kv_heads, span, tile_n)
    num_segments = triton.next_power_of_2(num_segments)
    split = num_segments > 1

    counters = arrivals.counters(q.device, "split_kv_merge")
    if merge_in_kernel is None:
        merge_in_kernel = num_seqs <= MERGE_IN_KERNEL_MAX_SEQS
    merge_last = split and merge_in_kernel and counters is not None and q_blocks * num_kv_heads <= counters.numel()
    if split:
        part_acc = torch.empty(num_tokens, num_q_heads, num_segments, block_d, dtype=torch.float32, device=q.device)
        part_m = torch.empty(num_tokens, num_q_heads, num_segments, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused

    common = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, NUM_Q_HEADS=num_q_heads, BLOCK_M=block_m,
                  **pdl.launch(q))  # fmt: skip
    _attn_kernel[(q_blocks, num_kv_heads, num_segments)](
        q, k_cache, v_cache, out,
        part_acc, part_m, part_l, counters if merge_last else out,
        query_start_loc, seq_lens, block_tables, out if sinks is None else sinks, k_scale, v_scale,
        scale * 1.4426950408889634, num_seqs,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        BLOCK_Q=block_q, TILE_N=tile_n, PAGE=page, NUM_SEGMENTS=num_segments, SPLIT=split,
        MIN_SEG_TILES=min_seg_tiles, IEEE=q.dtype == torch.float32, WINDOW=max(sliding_window, 0),
        SINKS=sinks is not None, FP8=fp8, F16_DOTS=f16_dots, MERGE_LAST=merge_last, num_warps=num_warps,
        num_stages=num_stages, **common,
    )  # fmt: skip
    if split and not merge_last:
        _reduce_kernel[(q_blocks, num_kv_heads)](
            out, part_acc, part_m, part_l, query_start_loc, seq_lens, out if sinks is None else sinks, num_seqs,
            out.stride(0), out.stride(1),
            BLOCK_Q=block_q, NUM_SEGMENTS=num_segments, SINKS=sinks is not None, TILE_N=tile_n,
            MIN_SEG_TILES=min_seg_tiles, WINDOW=max(sliding_window, 0), num_warps=4,
            **common,
        )  # fmt: skip
    return out
