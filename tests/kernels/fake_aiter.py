"""A stand-in `aiter` module for CPU tests. Its functions take keyword arguments only, with the
names of AITER's real signatures (aiter/ops/{attention,mha,cache,rmsnorm}.py), so a wrapper that passes an argument
positionally or misnames one fails here; each asserts the layouts AITER expects and computes the
reference in plain torch."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

CALLS: list[str] = []


def _norm(x, weight, eps):
    xf = x.float()
    return (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)).to(x.dtype)


def rmsnorm2d_fwd(*, input, weight, epsilon):
    CALLS.append("rmsnorm2d_fwd")
    assert input.dim() == 2, "AITER RMSNorm takes rows"
    return _norm(input, weight, epsilon)


def rmsnorm2d_fwd_with_add(*, out, input, residual_in, residual_out, weight, epsilon):
    CALLS.append("rmsnorm2d_fwd_with_add")
    assert input.dim() == 2 and input.shape == residual_in.shape == out.shape == residual_out.shape
    residual_out.copy_(input + residual_in)
    out.copy_(_norm(residual_out, weight, epsilon))


def silu_and_mul(*, out, input, limit=0.0):
    CALLS.append("silu_and_mul")
    gate, up = input.chunk(2, dim=-1)
    out.copy_(F.silu(gate) * up)


def rope_cached_positions_2c_fwd(
    *, input_x, input_y, cos, sin, positions, rotate_style, reuse_freqs_front_part, nope_first,
    transpose_output=False,
):  # fmt: skip
    CALLS.append("rope_cached_positions_2c_fwd")
    s, b = input_x.shape[:2]
    assert input_x.dim() == input_y.dim() == 4 and positions.shape == (s, b)
    assert cos.dim() == 4 and cos.shape[1:3] == (1, 1) and cos.shape[-1] * 2 == input_x.shape[-1]
    assert rotate_style == 0 and reuse_freqs_front_part and not nope_first and not transpose_output
    c = cos[positions.long()].squeeze(-2).squeeze(-2)  # [s, b, d/2]
    sn = sin[positions.long()].squeeze(-2).squeeze(-2)
    c, sn = c.unsqueeze(-2), sn.unsqueeze(-2)

    def rot(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * c - x2 * sn, x2 * c + x1 * sn], dim=-1)

    return rot(input_x), rot(input_y)


def reshape_and_cache_flash(
    *, key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, kv_layout=-1
):
    CALLS.append("reshape_and_cache_flash")
    assert key_cache.dim() == 4 and kv_cache_dtype == "auto"  # NHD pages [blocks, page, kvh, d]
    keep = slot_mapping >= 0
    key_cache.view(-1, *key_cache.shape[2:])[slot_mapping[keep]] = key[: slot_mapping.numel()][keep]
    value_cache.view(-1, *value_cache.shape[2:])[slot_mapping[keep]] = value[: slot_mapping.numel()][keep]


def _pages(cache, table, length):
    """The first `length` rows of one sequence from NHD pages [blocks, page, kvh, d]."""
    page = cache.shape[1]
    return cache[table[: -(-length // page)].long()].flatten(0, 1)[:length]


def _attend(q, k, v, scale, keep):
    """q [Lq, Hq, D], k/v [Lk, Hkv, D], keep [Lq, Lk]: softmax attention in fp32; rows with no key give 0."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    p = s.masked_fill(~keep, float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, v)


def paged_attention_v1(
    *, out, workspace_buffer, query, key_cache, value_cache, scale, block_tables, cu_query_lens, context_lens,
    max_context_len, alibi_slopes, kv_cache_dtype, kv_cache_layout, logits_soft_cap, k_scale, v_scale,
    fp8_out_scale=None, partition_size=256, mtp=1, sliding_window=0,
):  # fmt: skip
    """Decode rows only: a sequence whose query_len (from cu_query_lens) exceeds 1 is skipped, as the
    HIP kernel does; a sequence with no context leaves its row undefined (NaN here)."""
    CALLS.append("paged_attention_v1")
    assert query.dtype in (torch.float16, torch.bfloat16) and out.dtype == query.dtype, "fp16/bf16 only"
    assert kv_cache_dtype == "auto" and kv_cache_layout == "NHD" and key_cache.dim() == 4
    assert alibi_slopes is None and logits_soft_cap == 0.0 and fp8_out_scale is None and mtp == 1
    assert query.stride(-1) == 1 and query.stride(1) == query.shape[2], "heads packed, rows may stride"
    assert block_tables.dtype == context_lens.dtype == cu_query_lens.dtype == torch.int32
    num_seqs = block_tables.shape[0]  # the kernel's batch is the block table's rows
    assert context_lens.shape == (num_seqs,) and cu_query_lens.shape == (num_seqs + 1,)
    assert isinstance(max_context_len, int) and max_context_len >= int(context_lens.max())
    parts = -(-max_context_len // partition_size)
    need = num_seqs * query.shape[1] * parts * (query.shape[2] * query.element_size() + 8)
    assert workspace_buffer.dtype == torch.uint8 and workspace_buffer.numel() >= need, "workspace too small"
    for i in range(num_seqs):
        row, q_len, ctx = int(cu_query_lens[i]), int(cu_query_lens[i + 1] - cu_query_lens[i]), int(context_lens[i])
        if q_len > 1:
            continue
        if ctx == 0:
            out[row] = float("nan")
            continue
        pos = torch.arange(ctx)
        keep = (pos >= ctx - sliding_window) if sliding_window > 0 else torch.ones(ctx, dtype=torch.bool)
        k, v = _pages(key_cache, block_tables[i], ctx), _pages(value_cache, block_tables[i], ctx)
        out[row] = _attend(query[row : row + 1], k, v, scale, keep[None])[0].to(out.dtype)
    return out


def flash_attn_varlen_func(
    *, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, min_seqlen_q=0, dropout_p=0.0,
    softmax_scale=None, logits_soft_cap=0.0, causal=False, window_size=(-1, -1, 0), bias=None,
    alibi_slopes=None, deterministic=False, return_lse=False, return_attn_probs=False, how_v3_bf16_cvt=1,
    block_table=None, out=None, cu_seqlens_q_padded=None, cu_seqlens_k_padded=None, sink_ptr=None,
):  # fmt: skip
    """Paged varlen attention as AITER's CK path computes it: causal bottom-right aligned; query i of a
    sequence (position p = i + seqlen_k - seqlen_q) sees keys p - window[0] .. p + window[1]."""
    CALLS.append("flash_attn_varlen_func")
    assert q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype, "fp16/bf16 only"
    assert block_table is not None and block_table.dtype == torch.int32 and block_table.stride(-1) == 1
    assert k.dim() == 4 and k.shape[1] % 128 == 0, "Paged KV cache block size must be divisible by 128"
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32 and q.shape[-1] % 8 == 0
    assert dropout_p == 0.0 and bias is None and alibi_slopes is None and sink_ptr is None
    assert len(window_size) == 3 and window_size[2] == 0, "(left, right, sink)"
    batch = cu_seqlens_q.numel() - 1
    assert block_table.shape[0] == batch and cu_seqlens_k.shape == (batch + 1,)
    q_lens, k_lens = cu_seqlens_q.diff(), cu_seqlens_k.diff()
    assert max_seqlen_q >= int(q_lens.max()) and max_seqlen_k >= int(k_lens.max())
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.dtype == q.dtype
    left, right = window_size[0], window_size[1]
    for b in range(batch):
        qs, sq, sk = int(cu_seqlens_q[b]), int(q_lens[b]), int(k_lens[b])
        if sq == 0:
            continue
        p = torch.arange(sq)[:, None] + sk - sq
        j = torch.arange(sk)[None, :]
        keep = torch.ones(sq, sk, dtype=torch.bool)
        if causal:
            keep &= j <= p
        if left >= 0:
            keep &= j >= p - left
        if right >= 0:
            keep &= j <= p + right
        kk, vv = _pages(k, block_table[b], sk), _pages(v, block_table[b], sk)
        out[qs : qs + sq] = _attend(q[qs : qs + sq], kk, vv, softmax_scale, keep).to(out.dtype)
    return out


def module() -> types.ModuleType:
    mod = types.ModuleType("aiter")
    for fn in (rmsnorm2d_fwd, rmsnorm2d_fwd_with_add, silu_and_mul, rope_cached_positions_2c_fwd,
               reshape_and_cache_flash, paged_attention_v1, flash_attn_varlen_func):  # fmt: skip
        setattr(mod, fn.__name__, fn)
    return mod
