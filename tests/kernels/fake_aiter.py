"""A stand-in `aiter` module for CPU tests. Its functions take keyword arguments only, with the
names of AITER's real signatures (aiter/ops/{attention,mha,cache,rmsnorm,moe_op,topk}.py,
aiter/fused_moe.py and aiter/mla.py), so a wrapper that passes an argument positionally or misnames one fails here;
each asserts the layouts AITER expects and computes the reference in plain torch, written out here
rather than calling atomc's. `install(monkeypatch)` puts it in sys.modules as `aiter`,
`aiter.fused_moe` and `aiter.mla`; `install(monkeypatch, fp8=torch.float8_e4m3fnuz)` makes it an MI300
(`aiter.dtypes.fp8`; the FP8 functions are fake_aiter_fp8.py; quantised experts and the GEMMs over
pre-shuffled weights fake_aiter_shuffled.py)."""

from __future__ import annotations

import enum
import sys
import types

import torch
import torch.nn.functional as F

if __package__:  # imported as tests.kernels.fake_aiter (tests/passes does)
    from . import fake_aiter_fp8, fake_aiter_shuffled
else:  # as fake_aiter, from tests/kernels
    import fake_aiter_fp8
    import fake_aiter_shuffled

CALLS: list[str] = fake_aiter_fp8.CALLS  # one record of calls, the FP8 functions' too


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


# ---- MoE: enums (csrc/include/aiter_enum.h), routing (ops/moe_op.py, ops/topk.py), fused_moe ----


class ActivationType(enum.Enum):
    No = -1
    Silu = 0
    Gelu = 1
    Swiglu = 2
    Situv2 = 3


class QuantType(enum.Enum):
    No = 0
    per_Tensor = 1
    per_Token = 2
    per_1x32 = 3
    per_1x128 = 4
    per_128x128 = 5
    per_256x128 = 6
    per_1024x128 = 7


GATING_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_topk_outputs(weights, ids, gating_output, name_ids="topk_ids"):
    assert gating_output.dim() == 2 and gating_output.dtype in GATING_DTYPES and gating_output.is_contiguous()
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32, f"topk_weights fp32, {name_ids} int32"
    assert weights.shape == ids.shape and weights.shape[0] == gating_output.shape[0]
    assert 1 <= ids.shape[1] <= gating_output.shape[1]


def _renormalise(w, need_renorm):
    return w / w.sum(dim=-1, keepdim=True) if need_renorm else w


def topk_softmax(
    *, topk_weights, topk_indices, token_expert_indices, gating_output, need_renorm, num_shared_experts=0,
    shared_expert_scoring_func="",
):  # fmt: skip
    """Top-k of the logits (softmax is monotone), weights exp(l - max) / sum over all experts."""
    CALLS.append("topk_softmax")
    _check_topk_outputs(topk_weights, topk_indices, gating_output, "topk_indices")
    assert token_expert_indices.shape == topk_indices.shape and token_expert_indices.dtype == torch.int32
    assert isinstance(need_renorm, bool) and num_shared_experts == 0 and shared_expert_scoring_func == ""
    logits = gating_output.float()
    t, k = topk_indices.shape
    top, idx = logits.topk(k, dim=-1)
    mx = logits.max(dim=-1, keepdim=True).values
    w = (top - mx).exp() / (logits - mx).exp().sum(dim=-1, keepdim=True)
    topk_weights.copy_(_renormalise(w, need_renorm))
    topk_indices.copy_(idx)
    # slot-major row index of each (token, slot), as the kernel reports it
    token_expert_indices.copy_(torch.arange(k, dtype=torch.int32)[None, :] * t + torch.arange(t)[:, None])


def _in_best_groups(choice, num_expert_group, topk_group, group_score):
    """[T, E] bool: whether each expert is in one of its token's `topk_group` best groups."""
    t, e = choice.shape
    assert e % num_expert_group == 0 and 1 <= topk_group <= num_expert_group
    groups = choice.view(t, num_expert_group, e // num_expert_group)
    best = group_score(groups).topk(topk_group, dim=-1).indices
    keep = torch.zeros(t, num_expert_group, dtype=torch.bool).scatter(1, best, True)
    return keep[..., None].expand(groups.shape).reshape(t, e)


def grouped_topk(
    *, gating_output, topk_weights, topk_ids, num_expert_group, topk_group, need_renorm, is_softmax=True,
    routed_scaling_factor=1.0,
):  # fmt: skip
    """A group's score is its best expert's; weights are the chosen scores."""
    CALLS.append("grouped_topk")
    _check_topk_outputs(topk_weights, topk_ids, gating_output)
    logits = gating_output.float()
    scores = logits.softmax(-1) if is_softmax else logits.sigmoid()
    keep = _in_best_groups(scores, num_expert_group, topk_group, lambda g: g.amax(-1))
    w, idx = scores.masked_fill(~keep, 0.0).topk(topk_ids.shape[1], dim=-1)
    topk_weights.copy_(_renormalise(w, need_renorm) * routed_scaling_factor)
    topk_ids.copy_(idx)


def biased_grouped_topk(
    *, gating_output, correction_bias, topk_weights, topk_ids, num_expert_group, topk_group, need_renorm,
    routed_scaling_factor=1.0,
):  # fmt: skip
    """Sigmoid scores; experts chosen on score + bias, a group's score the sum of its best two;
    weights the unbiased scores of the chosen."""
    CALLS.append("biased_grouped_topk")
    _check_topk_outputs(topk_weights, topk_ids, gating_output)
    assert correction_bias.shape == (gating_output.shape[1],)
    assert correction_bias.dtype in (torch.float32, gating_output.dtype)
    assert need_renorm, "moe_fused_gate (the many-token path) asserts need_renorm"
    scores = gating_output.float().sigmoid()
    choice = scores + correction_bias.float()
    keep = _in_best_groups(choice, num_expert_group, topk_group, lambda g: g.topk(2, dim=-1).values.sum(-1))
    idx = choice.masked_fill(~keep, float("-inf")).topk(topk_ids.shape[1], dim=-1).indices
    w = scores.gather(1, idx)
    topk_weights.copy_(_renormalise(w, need_renorm) * routed_scaling_factor)
    topk_ids.copy_(idx)


def fused_moe(
    *, hidden_states, w1, w2, topk_weight, topk_ids, expert_mask=None, activation=ActivationType.Silu,
    quant_type=QuantType.No, doweight_stage1=False, w1_scale=None, w2_scale=None, a1_scale=None, a2_scale=None,
    block_size_M=None, num_local_tokens=None, moe_sorting_dispatch_policy=0, dtype=None, hidden_pad=0,
    intermediate_pad=0, bias1=None, bias2=None, splitk=0, swiglu_limit=None, beta=None, linear_beta=None,
    gate_mode="separated", shared_w1=None, shared_w2=None, shared_w1_scale=None, shared_w2_scale=None,
    shared_expert_id=-1, stage2_scatter=None,
):  # fmt: skip
    """Unquantised g1u1 SiLU experts. With `expert_mask` [n] (0/1 int32), an id's weight row is the
    number of ones before it and ids whose mask is 0 contribute nothing. Stage 1 (gate/up, SiLU * up)
    rounds to the output dtype, as the two-kernel path stores it; the weighted sum is in fp32."""
    CALLS.append("fused_moe")
    assert isinstance(activation, ActivationType) and isinstance(quant_type, QuantType), "AITER's enums"
    assert activation == ActivationType.Silu and quant_type == QuantType.No, "the stand-in runs unquantised SiLU"
    assert not doweight_stage1 and dtype is None and bias1 is None and bias2 is None and swiglu_limit is None
    assert all(s is None for s in (w1_scale, w2_scale, a1_scale, a2_scale, num_local_tokens, stage2_scatter))
    assert shared_w1 is None and shared_w2 is None and shared_expert_id == -1
    m, dim = hidden_states.shape
    e, two_inter, dim1 = w1.shape
    inter = two_inter // 2
    assert dim1 == dim and w2.shape == (e, dim, inter), f"w1 [E, 2I, dim], w2 [E, dim, I]: {w1.shape} {w2.shape}"
    assert hidden_states.dtype in (torch.float16, torch.bfloat16), "Fused_moe unsupported out dtype"
    assert w1.dtype == w2.dtype == hidden_states.dtype and hidden_states.is_contiguous()
    assert topk_weight.dtype == torch.float32 and topk_ids.dtype == torch.int32
    assert topk_weight.shape == topk_ids.shape and topk_ids.shape[0] == m
    rows = fake_aiter_shuffled.expert_rows(topk_ids, expert_mask, e)
    out = torch.zeros(m, dim, dtype=torch.float32)
    token, slot = torch.nonzero(rows >= 0, as_tuple=True)
    for t, s in zip(token.tolist(), slot.tolist(), strict=True):  # one (token, expert) pair at a time
        r = int(rows[t, s])
        h = hidden_states[t].float() @ w1[r].float().T
        gate, up = h[:inter], h[inter:]
        a = (gate * torch.sigmoid(gate) * up).to(hidden_states.dtype).float()
        y = (a @ w2[r].float().T).to(hidden_states.dtype).float()
        out[t] += topk_weight[t, s] * y
    return out.to(hidden_states.dtype)


# ---- MLA: the latent cache write (ops/cache.py), decode and prefill (mla.py) ----


def concat_and_cache_mla(*, kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale):
    """[kv_c | k_pe] of the first slot_mapping.numel() tokens into kv_cache [blocks, page, r + pe]."""
    CALLS.append("concat_and_cache_mla")
    assert kv_cache.dim() == 3 and kv_cache.shape[2] == kv_c.shape[1] + k_pe.shape[1], "[blocks, page, r + pe]"
    assert kv_c.dim() == k_pe.dim() == 2 and kv_c.stride(1) == k_pe.stride(1) == 1, "rows may stride, values not"
    assert slot_mapping.dtype == torch.int64 and kv_cache_dtype == "auto"
    assert scale.dtype == torch.float32 and scale.numel() == 1
    t = slot_mapping.numel()
    keep = slot_mapping >= 0
    rows = torch.cat([kv_c[:t], k_pe[:t]], dim=-1)[keep].to(kv_cache.dtype)
    kv_cache.view(-1, kv_cache.shape[2])[slot_mapping[keep]] = rows


def _check_mla(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, page_size):
    assert q.dim() == 3 and q.is_contiguous(), "Q [tokens, heads, kv_lora + rope], contiguous"
    assert kv_buffer.dim() == 4 and kv_buffer.shape[1] == page_size and kv_buffer.shape[2] == 1, (
        "kv_buffer [pages, page_size, nhead_kv == 1, D]"
    )
    assert kv_buffer.shape[3] == q.shape[2], "head_size == KV.size(3)"
    assert o.dim() == 3 and o.shape[:2] == q.shape[:2] and o.shape[2] < q.shape[2], "o [tokens, heads, v_head_dim]"
    assert q.dtype == kv_buffer.dtype == o.dtype == torch.bfloat16, "bf16 (the stand-in runs no fp8)"
    for t in (qo_indptr, kv_indptr, kv_indices, kv_last_page_lens):
        assert t.dtype == torch.int32 and t.dim() == 1
    bs = qo_indptr.numel() - 1
    assert kv_indptr.shape == (bs + 1,) and kv_last_page_lens.shape == (bs,)
    assert kv_indices.numel() >= int(kv_indptr[-1]) and q.shape[0] >= int(qo_indptr[-1])
    assert isinstance(max_seqlen_q, int) and max_seqlen_q >= int(qo_indptr.diff().max())
    assert page_size & (page_size - 1) == 0, "log2 of the page size"


def _mla_reference(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, page_size, sm_scale):
    """Causal (bottom-right aligned) attention of each sequence's queries over its KV: kv_indptr
    counts pages (tokens when page_size is 1), the last page holding kv_last_page_lens tokens; the
    value is the first v_head_dim values of each key."""
    v_dim = o.shape[2]
    rows = kv_buffer.flatten(0, 1)[:, 0]  # [pages * page_size, D]
    for b in range(qo_indptr.numel() - 1):
        qs, qe = int(qo_indptr[b]), int(qo_indptr[b + 1])
        pages = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
        if qe == qs:
            continue
        length = (pages.numel() - 1) * page_size + int(kv_last_page_lens[b]) if page_size > 1 else pages.numel()
        token = (pages[:, None] * page_size + torch.arange(page_size)).flatten()[:length]
        k = rows[token].float()  # [L, D]
        s = torch.einsum("qhd,kd->hqk", q[qs:qe].float(), k) * sm_scale
        sq = qe - qs
        keep = torch.arange(length)[None, :] <= torch.arange(sq)[:, None] + length - sq
        p = s.masked_fill(~keep, float("-inf")).softmax(-1)
        o[qs:qe] = torch.einsum("hqk,kd->qhd", p, k[:, :v_dim]).to(o.dtype)


def mla_decode_fwd(
    *, q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, page_size=1, nhead_kv=1,
    sm_scale=None, logit_cap=0.0, num_kv_splits=None, num_kv_splits_indptr=None, work_meta_data=None,
    work_indptr=None, work_info_set=None, reduce_indptr=None, reduce_final_map=None, reduce_partial_map=None,
    q_scale=None, kv_scale=None, intra_batch_mode=False, return_logits=False, return_lse=False, g_kv_indptr=None,
    cp_world_size=1, cp_rank=0, causal=True,
):  # fmt: skip
    """Writes o; returns (o, lse or None) as aiter.mla does."""
    CALLS.append("mla_decode_fwd")
    assert logit_cap <= 0, f"{logit_cap=} is not support yet"
    assert nhead_kv == 1, "only support num_kv_heads==1 for now"
    assert q.shape[1] in (8, 16, 32, 64, 128), "the gqa ratios with bf16 decode kernels"
    assert work_meta_data is None and q_scale is None and kv_scale is None and cp_world_size == 1 and causal
    assert not return_logits and not return_lse and not intra_batch_mode
    _check_mla(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, page_size)
    scale = sm_scale if sm_scale is not None else q.shape[2] ** -0.5
    _mla_reference(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, page_size, scale)
    return o, None


def mla_prefill_fwd(
    *, q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, sm_scale=None,
    logit_cap=0.0, num_kv_splits=None,
):  # fmt: skip
    """The absorbed causal prefill (asm, one KV split): writes o; returns (o, lse)."""
    CALLS.append("mla_prefill_fwd")
    assert logit_cap <= 0, f"{logit_cap=} is not support yet"
    assert q.shape[1] in (16, 128), "only support num_q_heads/num_kv_heads==16 or 128 for now"
    _check_mla(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, kv_buffer.shape[1])
    scale = sm_scale if sm_scale is not None else q.shape[2] ** -0.5
    _mla_reference(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, kv_buffer.shape[1], scale)
    return o, torch.zeros(o.shape[0], 1, o.shape[1], 1)


def module(fp8: torch.dtype = torch.float8_e4m3fn) -> types.ModuleType:
    """The stand-in; `fp8` is the GPU's e4m3 dtype (`aiter.dtypes.fp8`): fn as on MI350, fnuz as on MI300."""
    mod = types.ModuleType("aiter")
    fake_aiter_fp8.FP8[0] = fp8
    mod.dtypes = types.SimpleNamespace(
        fp8=fp8, fp16=torch.float16, bf16=torch.bfloat16, fp32=torch.float32, i8=torch.int8, i32=torch.int32
    )
    for fn in fake_aiter_fp8.FUNCTIONS:
        setattr(mod, fn.__name__, fn)
    for fn in (rmsnorm2d_fwd, rmsnorm2d_fwd_with_add, silu_and_mul, rope_cached_positions_2c_fwd,
               reshape_and_cache_flash, paged_attention_v1, flash_attn_varlen_func, topk_softmax, grouped_topk,
               biased_grouped_topk, concat_and_cache_mla):  # fmt: skip
        setattr(mod, fn.__name__, fn)
    mod.ActivationType, mod.QuantType = ActivationType, QuantType
    sub = types.ModuleType("aiter.fused_moe")  # fused_moe lives in a submodule `import aiter` does not load
    sub.fused_moe = fused_moe
    mod.fused_moe = sub
    mla = types.ModuleType("aiter.mla")  # MLA decode and prefill live in aiter/mla.py
    mla.mla_decode_fwd, mla.mla_prefill_fwd = mla_decode_fwd, mla_prefill_fwd
    mod.mla = mla
    fake_aiter_shuffled.extend(mod)  # quantised experts and the pre-shuffled GEMMs
    return mod


def install(monkeypatch, fp8: torch.dtype = torch.float8_e4m3fn) -> types.ModuleType:
    """The stand-in as `aiter` (and `aiter.fused_moe`, `aiter.mla`) for one test; CALLS cleared."""
    mod = module(fp8)
    monkeypatch.setitem(sys.modules, "aiter", mod)
    monkeypatch.setitem(sys.modules, "aiter.fused_moe", mod.fused_moe)
    monkeypatch.setitem(sys.modules, "aiter.mla", mod.mla)
    CALLS.clear()
    return mod
