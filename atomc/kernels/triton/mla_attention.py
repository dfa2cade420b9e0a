"""Multi-head latent attention (DeepSeek-V2/V3, absorbed form) over the paged latent cache.

Every token caches one latent row [c_kv | k_pe] (kv_lora + rope values, e.g. 512 + 64) shared by
all H heads: the key of every head is the whole row, its value the c_kv part (atomc/ops/mla.py).
So MLA is multi-query attention with one wide head, and what costs is reading the latent rows:
a kernel should load each latent tile once and use it for as many query rows as it can.

One kernel for decode, prefill, chunked prefill over a cached prefix and mixed batches:
- The M rows of a program's tile are BLOCK_Q query tokens x BLOCK_H heads, heads of one token
  first (row m = token m // BLOCK_H, head m % BLOCK_H of the program's head block). Any packing of
  rows shares the latent tile (it is the same for every head and token); packing heads first keeps
  the tile's tokens few, so a prefill tile's causal range ends closer to its queries (fewer tiles
  past the diagonal are loaded and masked), decode needs no token packing at all, and the rows of
  one token's heads are contiguous in q. H heads that do not fit one tile (V3: 128 with BLOCK_H 16,
  whose fp32 accumulator [16, 512] already fills a warp group's registers) go to head blocks, a
  grid axis; the programs of one token's head blocks read the same latent tiles at about the same
  time, so all but the first read hit L2.
- Scores are q_absorbed . c_kv + q_pe . k_pe (two dots, no concatenation), the value tile is the
  very c_kv tile the scores used (loaded once), the accumulator [BLOCK_M, kv_lora] fp32.
- Split-KV for decode at small batch (`SPLIT`): each sequence's context is cut into NUM_SEGMENTS
  pieces, partial (max, sum, acc) go to fp32 scratch, and a reduce kernel merges them by their
  log-sum-exp, as the MHA decode does (paged_attention.py, whose sequence lookup and segment
  choice this file reuses).

Prefill in this absorbed form costs (kv_lora + rope) + kv_lora = 1088 multiply-adds a head and key
pair at V3's widths, against 192 + 128 for the expanded form (per-head K/V up-projected from the
latent, then ordinary attention): long prompts would run faster expanded, at the price of
materialising K/V per chunk. Absorbed is what this kernel does for every batch today, so one
kernel, one cache read path and one set of tests cover decode, prefill and mixed steps.

No host sync in the wrapper (grid sizes from host ints; `max_seq_len` may be an upper bound), so
it is captured in CUDA graphs like the MHA kernel. `write_latent_cache` scatters this step's rows
(c_kv and k_pe straight from their own tensors, no concatenation) into the pages.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomc.kernels.triton.paged_attention import MIN_SEG_TILES, _find_seq, _pick_segments


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _mla_kernel(
    qc_ptr, qr_ptr, cache_ptr, out_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    qk_scale, num_seqs,
    stride_qct, stride_qch, stride_qrt, stride_qrh,
    stride_cb, stride_cs,
    stride_ot, stride_oh,
    stride_bt,
    KV_LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, PAGE: tl.constexpr, NUM_SEGMENTS: tl.constexpr, SPLIT: tl.constexpr,
    MIN_SEG_TILES: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
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

    offs_m = tl.arange(0, BLOCK_M)
    q_local = q_block_local * BLOCK_Q + offs_m // BLOCK_H
    head = head_block * BLOCK_H + offs_m % BLOCK_H
    row_ok = (q_local < q_len) & (head < NUM_HEADS)
    q_pos = prefix + q_local  # causal: key n is visible iff n <= q_pos
    tok = (q_start + q_local).to(tl.int64)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    c_ok = offs_c < KV_LORA
    r_ok = offs_r < ROPE

    qc = tl.load(
        qc_ptr + (tok * stride_qct + head * stride_qch)[:, None] + offs_c[None, :],
        mask=row_ok[:, None] & c_ok[None, :], other=0.0,
    )  # fmt: skip
    qr = tl.load(
        qr_ptr + (tok * stride_qrt + head * stride_qrh)[:, None] + offs_r[None, :],
        mask=row_ok[:, None] & r_ok[None, :], other=0.0,
    )  # fmt: skip

    kv_end = tl.minimum(seq_len, prefix + (q_block_local + 1) * BLOCK_Q)  # keys the block can see
    kv_begin = 0
    if SPLIT:
        # per-sequence segment length, a multiple of TILE_N and at least MIN_SEG_TILES tiles
        # (a short context leaves the last segments empty rather than one tile per program)
        seg_len = tl.maximum(tl.cdiv(seq_len, NUM_SEGMENTS * TILE_N), MIN_SEG_TILES) * TILE_N
        kv_begin = seg * seg_len
        kv_end = tl.minimum(kv_end, kv_begin + seg_len)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, TILE_N)
    for start in range(kv_begin, kv_end, TILE_N):
        n = start + offs_n
        n_ok = n < kv_end
        page = tl.load(bt_row + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        row = page * stride_cb + (n % PAGE) * stride_cs
        kc = tl.load(cache_ptr + row[:, None] + offs_c[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0.0)
        kr = tl.load(
            cache_ptr + row[:, None] + KV_LORA + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0
        )
        if IEEE:
            s = tl.dot(qc, tl.trans(kc), input_precision="ieee")
            s = tl.dot(qr, tl.trans(kr), s, input_precision="ieee")
        else:
            s = tl.dot(qc, tl.trans(kc))
            s = tl.dot(qr, tl.trans(kr), s)
        s = s * qk_scale  # log2 domain: qk_scale = scale * log2(e)
        visible = row_ok[:, None] & n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked row: no inf - inf
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p.to(kc.dtype), kc, input_precision="ieee")
        else:
            pv = tl.dot(p.to(kc.dtype), kc)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if SPLIT:
        # scratch [T, H, NUM_SEGMENTS(, BLOCK_C)], unnormalised
        idx = (tok * NUM_HEADS + head) * NUM_SEGMENTS + seg
        tl.store(part_m_ptr + idx, m_i, mask=row_ok)
        tl.store(part_l_ptr + idx, l_i, mask=row_ok)
        tl.store(part_acc_ptr + idx[:, None] * BLOCK_C + offs_c[None, :], acc, mask=row_ok[:, None])
    else:
        l_safe = tl.where(l_i > 0, l_i, 1.0)  # a row with no keys writes zeros, not NaN
        o = acc / l_safe[:, None]
        tl.store(
            out_ptr + (tok * stride_ot + head * stride_oh)[:, None] + offs_c[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & c_ok[None, :],
        )


@triton.jit(do_not_specialize=["num_seqs"])
def _mla_reduce_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, query_start_loc_ptr, num_seqs,
    stride_ot, stride_oh,
    KV_LORA: tl.constexpr, BLOCK_C: tl.constexpr, NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
):  # fmt: skip
    # the attention kernel's q-block mapping, so only rows some sequence owns are written
    head_block = tl.program_id(0) % HEAD_BLOCKS
    q_block = tl.program_id(0) // HEAD_BLOCKS
    seq = _find_seq(q_block, query_start_loc_ptr, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= q_len:
        return
    offs_m = tl.arange(0, BLOCK_M)
    q_local = q_block_local * BLOCK_Q + offs_m // BLOCK_H
    head = head_block * BLOCK_H + offs_m % BLOCK_H
    row_ok = (q_local < q_len) & (head < NUM_HEADS)
    tok = (q_start + q_local).to(tl.int64)
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_c = tl.arange(0, BLOCK_C)

    base = (tok * NUM_HEADS + head) * NUM_SEGMENTS
    m = tl.load(part_m_ptr + base[:, None] + offs_s[None, :], mask=row_ok[:, None], other=float("-inf"))
    lsum = tl.load(part_l_ptr + base[:, None] + offs_s[None, :], mask=row_ok[:, None], other=0.0)
    m_max = tl.max(m, 1)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max[:, None])  # an empty segment (m = -inf) weighs 0
    denom = tl.sum(w * lsum, 1)
    acc = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    for s in range(NUM_SEGMENTS):
        a = tl.load(part_acc_ptr + (base + s)[:, None] * BLOCK_C + offs_c[None, :], mask=row_ok[:, None], other=0.0)
        w_s = tl.sum(tl.where(offs_s[None, :] == s, w, 0.0), 1)
        acc += a * w_s[:, None]
    denom = tl.where(denom > 0, denom, 1.0)
    o = acc / denom[:, None]
    tl.store(
        out_ptr + (tok * stride_ot + head * stride_oh)[:, None] + offs_c[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (offs_c < KV_LORA)[None, :],
    )


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
    num_stages: int = 2,
) -> torch.Tensor:
    """Causal latent attention of q_absorbed [T, H, kv_lora] and q_pe [T, H, rope] over the latent
    pages [blocks, page, 1, kv_lora + rope]; writes out [T, H, kv_lora].

    Sequence i's queries are rows query_start_loc[i]:query_start_loc[i+1], the last q_len of its
    seq_lens[i] positions; rows no sequence owns are left untouched. `num_segments` forces split-KV
    (> 1) or not (1); by default decode batches too small to fill the GPU are split. `block_h`
    (heads a tile, a power of two), `tile_n` (keys a step, >= 16), `num_warps`, `num_stages`:
    tuning knobs for benchmarks."""
    num_tokens, num_heads, kv_lora = q_absorbed.shape
    _, page, one, latent_dim = latent_cache.shape
    rope = latent_dim - kv_lora
    assert one == 1 and rope > 0, f"latent pages {tuple(latent_cache.shape)} do not fit kv_lora {kv_lora}"
    assert q_pe.shape == (num_tokens, num_heads, rope) and out.shape[1:] == (num_heads, kv_lora)
    assert q_absorbed.stride(-1) == 1 and q_pe.stride(-1) == 1 and out.stride(-1) == 1
    assert latent_cache.stride(-1) == 1
    if num_seqs == 0 or num_tokens == 0:
        return out
    decode = max_query_len == 1
    if block_h is None:
        # decode: 32 heads a program (the H200 sweep at V3 widths, bs 64 x 4k: 458 us against 950 us
        # for 16 heads, 32 keys, 8 warps); prefill: a [16, 512] fp32 accumulator a program
        block_h = 32 if decode else 16
    block_h = min(triton.next_power_of_2(num_heads), triton.next_power_of_2(block_h))
    # decode: one token a program (at least 16 rows for tl.dot); prefill: 32 rows, about what the
    # [rows, kv_lora] fp32 accumulator leaves registers for at kv_lora 512
    block_m = max(16 if decode else 32, block_h)
    block_q = block_m // block_h
    head_blocks = triton.cdiv(num_heads, block_h)
    block_c = max(16, triton.next_power_of_2(kv_lora))
    block_r = max(16, triton.next_power_of_2(rope))
    if tile_n is None:
        # a [64, 576] bf16 latent tile is 72 KiB of shared memory a stage (decode); fp32 tiles twice that
        tile_n = (64 if decode else 32) if latent_cache.element_size() <= 2 else 16
    if num_warps is None:
        num_warps = 4 if decode else (8 if block_m * block_c >= 16 * 512 else 4)
    q_blocks = num_tokens // block_q + num_seqs  # upper bound (see _find_seq); spare programs exit

    if num_segments is None:
        num_segments = _pick_segments(q_absorbed.device, num_seqs, head_blocks, max_seq_len, tile_n) if decode else 1
    num_segments = triton.next_power_of_2(num_segments)
    split = num_segments > 1
    if split:
        dev = q_absorbed.device
        part_acc = torch.empty(num_tokens, num_heads, num_segments, block_c, dtype=torch.float32, device=dev)
        part_m = torch.empty(num_tokens, num_heads, num_segments, dtype=torch.float32, device=dev)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused

    common = dict(
        KV_LORA=kv_lora, BLOCK_C=block_c, NUM_HEADS=num_heads, BLOCK_H=block_h, HEAD_BLOCKS=head_blocks,
        BLOCK_M=block_m,
    )  # fmt: skip
    _mla_kernel[(head_blocks * q_blocks, num_segments)](
        q_absorbed, q_pe, latent_cache, out,
        part_acc, part_m, part_l,
        query_start_loc, seq_lens, block_tables,
        scale * 1.4426950408889634, num_seqs,
        q_absorbed.stride(0), q_absorbed.stride(1), q_pe.stride(0), q_pe.stride(1),
        latent_cache.stride(0), latent_cache.stride(1),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        ROPE=rope, BLOCK_R=block_r, BLOCK_Q=block_q, TILE_N=tile_n, PAGE=page,
        NUM_SEGMENTS=num_segments, SPLIT=split, MIN_SEG_TILES=MIN_SEG_TILES,
        IEEE=q_absorbed.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages,
        **common,
    )  # fmt: skip
    if split:
        _mla_reduce_kernel[(head_blocks * q_blocks,)](
            out, part_acc, part_m, part_l, query_start_loc, num_seqs,
            out.stride(0), out.stride(1),
            BLOCK_Q=block_q, NUM_SEGMENTS=num_segments, num_warps=4,
            **common,
        )  # fmt: skip
    return out


@triton.jit
def _write_latent_kernel(
    c_ptr, r_ptr, cache_ptr, slot_ptr,
    stride_ct, stride_rt, stride_cb, stride_cs,
    KV_LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    PAGE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding
        return
    row = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    c = tl.load(c_ptr + t.to(tl.int64) * stride_ct + offs_c, mask=offs_c < KV_LORA)
    r = tl.load(r_ptr + t.to(tl.int64) * stride_rt + offs_r, mask=offs_r < ROPE)
    tl.store(row + offs_c, c.to(cache_ptr.dtype.element_ty), mask=offs_c < KV_LORA)
    tl.store(row + KV_LORA + offs_r, r.to(cache_ptr.dtype.element_ty), mask=offs_r < ROPE)


def write_latent_cache(
    c_kv: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """c_kv [T, kv_lora] and k_pe [T, rope] (T >= slot_mapping.numel()) -> their slots' latent rows
    [c_kv | k_pe] in pages [blocks, page, 1, kv_lora + rope]; slot -1 writes nothing."""
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    _, page, _, latent_dim = latent_cache.shape
    kv_lora, rope = c_kv.shape[-1], k_pe.shape[-1]
    assert kv_lora + rope == latent_dim and c_kv.stride(-1) == 1 and k_pe.stride(-1) == 1
    assert latent_cache.stride(-1) == 1
    _write_latent_kernel[(num_tokens,)](
        c_kv, k_pe, latent_cache, slot_mapping,
        c_kv.stride(0), k_pe.stride(0), latent_cache.stride(0), latent_cache.stride(1),
        KV_LORA=kv_lora, ROPE=rope, BLOCK_C=triton.next_power_of_2(kv_lora),
        BLOCK_R=triton.next_power_of_2(rope), PAGE=page, num_warps=4,
    )  # fmt: skip
