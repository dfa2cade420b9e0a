"""The stand-in `aiter`'s kernels over pre-shuffled weights (tests/kernels/fake_aiter.py installs them):
fused_moe's quantised experts (aiter/fused_moe.py: QuantType.per_Token, per_128x128, per_1x32) and,
for the FP8 linears, the pre-shuffled GEMMs of aiter/ops/gemm_op_a8w8.py. Keyword-only with AITER's
argument names, as the rest of the stand-in.

Each asserts what AITER requires as its source reads (see the notes at each), checks the weights are
in the layout shuffle_weight(layout=(16, 16)) writes and are tagged `is_shuffled` as its output is,
and computes the reference from the weights it unshuffles itself. The permutations here are copied
from aiter/ops/shuffle.py (shuffle_weight, shuffle_scale) and inverted by sorting the image of an
index grid, independently of atomc's own inverses (atomc/ops/aiter_layout.py), which the tests
compare with these.

What AITER computes and the weight-only reference does not (atomc/kernels/aiter/moe_quant.py):
FP8 experts quantise the input of both GEMMs to the weights' e4m3 dtype (per token for per_Token,
per 128 values for per_128x128, at amax / max as fake_aiter_fp8.py does); MXFP4 experts with
Swiglu keep bf16/fp16 activations below 256 tokens and quantise them to MXFP4 from there on, which
the stand-in refuses (a caller must slice).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

if __package__:
    from . import fake_aiter_fp8
else:
    import fake_aiter_fp8

CALLS = fake_aiter_fp8.CALLS
HALF = fake_aiter_fp8.HALF
FP4X2 = getattr(torch, "float4_e2m1fn_x2", torch.uint8)  # aiter.dtypes.fp4x2
FP8_E8M0 = getattr(torch, "float8_e8m0fnu", torch.uint8)  # aiter.dtypes.fp8_e8m0
SWIGLU_MXFP4_BF16_BOUND = 256  # fused_moe's _SWIGLU_MXFP4_BF16_BOUND (GPTOSS_SWIGLU_MXFP4_BF16_BOUND unset)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of the low three bits; bit 3 the sign


# ---- aiter/ops/shuffle.py ----


def _shuffle_grid(x: torch.Tensor, elem_bytes: int) -> torch.Tensor:
    """shuffle_weight's permutation with layout (16, 16) for elements of `elem_bytes` bytes."""
    in_, ik = 16, 16
    bk, k, bn = ik * 2, 16 // elem_bytes, in_
    assert x.shape[-2] % bn == 0, f"{x.shape[-2]} % {bn} == {x.shape[-2] % bn}"
    assert x.shape[-1] % bk == 0, f"{x.shape[-1]} % {bk} == {x.shape[-1] % bk}"
    x_ = x.view(-1, x.shape[-2] // bn, bn, x.shape[-1] // bk, bk // k, k).permute(0, 1, 3, 4, 2, 5)
    return x_.contiguous().view(*x.shape)


def shuffle_weight(x, layout=(16, 16), use_int4=False, is_guinterleave=False, gate_up=False, pad_k_to=0):
    """aiter.ops.shuffle.shuffle_weight, its (16, 16) path only (the one atomc uses)."""
    assert tuple(layout) == (16, 16) and not use_int4 and not is_guinterleave and not gate_up and not pad_k_to
    dtype = x.dtype
    out = _shuffle_grid(x.view(torch.uint8) if dtype == FP4X2 else x, x.element_size()).view(dtype)
    out.is_shuffled = True
    return out


def unshuffle_weight(w: torch.Tensor) -> torch.Tensor:
    """Row-major bytes of a one-byte weight shuffled by shuffle_weight(layout=(16, 16))."""
    b = w.view(torch.uint8)
    n, k = b.shape[-2:]
    grid = _shuffle_grid(torch.arange(n * k).view(n, k), 1).flatten()  # shuffled position -> source index
    return b.flatten(-2)[..., grid.argsort()].view(b.shape)


def shuffle_scale(src: torch.Tensor) -> torch.Tensor:
    """aiter.ops.shuffle.shuffle_scale (fp4_utils.e8m0_shuffle), without gate/up interleave."""
    assert src.ndim == 2, "scale must be a 2D tensor"
    m, n = src.shape
    padded = torch.empty((m + 255) // 256 * 256, (n + 7) // 8 * 8, dtype=src.dtype)
    padded[:m, :n] = src
    sm, sn = padded.shape
    return padded.view(sm // 32, 2, 16, sn // 8, 2, 4).permute(0, 3, 5, 2, 4, 1).contiguous().view(sm, sn)


def unshuffle_scale(s: torch.Tensor) -> torch.Tensor:
    """Row-major [R, C] of scales shuffle_scale wrote (R % 256 == 0, C % 8 == 0: nothing padded)."""
    b = s.view(torch.uint8)
    r, c = b.shape
    assert r % 256 == 0 and c % 8 == 0, "a padded shuffle_scale layout: the stand-in reads unpadded ones"
    grid = shuffle_scale(torch.arange(r * c).view(r, c)).flatten()
    return b.flatten()[grid.argsort()].view(r, c)


# ---- aiter/fused_moe.py: quantised experts ----


def expert_rows(topk_ids, expert_mask, e):
    """fused_moe's weight row of each (token, slot): the id itself, or with `expert_mask` (a 0/1
    int32 vector over the ids, E ones) the count of ones before it, -1 where the mask is 0."""
    if expert_mask is None:
        rows = topk_ids.long()
        assert int(rows.min()) >= 0 and int(rows.max()) < e
        return rows
    assert expert_mask.dim() == 1 and expert_mask.dtype == torch.int32 and int(expert_mask.sum()) == e
    assert int(topk_ids.min()) >= 0 and int(topk_ids.max()) < expert_mask.numel()
    row_of = torch.where(expert_mask > 0, expert_mask.cumsum(0) - 1, -1)
    return row_of[topk_ids.long()]


def _e2m1_e8m0(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] (low nibble first) with e8m0 [..., K/32] -> fp32 [..., K]."""
    lut = torch.tensor(E2M1)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()
    values = lut[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    scale = torch.exp2(scales.float() - 127.0).repeat_interleave(32, dim=-1)
    return values * scale


def _swiglu(gate, up, limit):
    """aiter/fused_moe.py `swiglu` (its torch reference of ActivationType.Swiglu)."""
    limit = 7.0 if limit is None else limit
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(1.702 * gate) * (up + 1)


def _quantised(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., K] fp32 through AITER's dynamic e4m3 quant (groups of `group`) and back."""
    rows = x.reshape(-1, x.shape[-1])
    q, s = fake_aiter_fp8._dynamic(rows, group)
    return (q.float() * s.repeat_interleave(group, dim=-1)).view(x.shape)


def _mxfp4_experts(w1, w2, w1_scale, w2_scale, dim, bias1, bias2):
    e, n1, kb = w1.shape
    inter = w2.shape[2] * 2
    assert w1.dtype == w2.dtype == FP4X2, f"MXFP4 weights in dtypes.fp4x2: {w1.dtype}, {w2.dtype}"
    assert kb * 2 == dim and n1 == 2 * inter and w2.shape == (e, dim, inter // 2), "g1u1 [E, 2I, H/2], [E, H, I/2]"
    assert w1_scale.shape == (e * n1, dim // 32) and w2_scale.shape == (e * dim, inter // 32), (
        f"e8m0 scales [E * N, K/32]: {tuple(w1_scale.shape)} {tuple(w2_scale.shape)}"
    )
    assert w1_scale.dtype == w2_scale.dtype == FP8_E8M0 and w1_scale.is_contiguous() and w2_scale.is_contiguous()
    for b, shape in ((bias1, (e, n1)), (bias2, (e, dim))):
        assert b is None or (b.dtype == torch.float32 and b.shape == shape), "expert biases fp32 [E, N]"
    s1 = unshuffle_scale(w1_scale).view(e, n1, -1)
    s2 = unshuffle_scale(w2_scale).view(e, dim, -1)
    return _e2m1_e8m0(unshuffle_weight(w1), s1), _e2m1_e8m0(unshuffle_weight(w2), s2), inter


def _fp8_experts(quant_type, qt, w1, w2, w1_scale, w2_scale, dim):
    e, n1, k1 = w1.shape
    inter = w2.shape[2]
    fp8 = fake_aiter_fp8.fp8()
    assert w1.dtype == w2.dtype == fp8, f"FP8 experts in dtypes.fp8 ({fp8}): {w1.dtype}, {w2.dtype}"
    assert k1 == dim and n1 == 2 * inter and w2.shape == (e, dim, inter), "g1u1 [E, 2I, H], [E, H, I]"
    assert w1_scale.dtype == w2_scale.dtype == torch.float32 and w1_scale.is_contiguous() and w2_scale.is_contiguous()
    w1f, w2f = unshuffle_weight(w1).view(fp8).float(), unshuffle_weight(w2).view(fp8).float()
    if quant_type == qt.per_Token:
        assert w1_scale.shape == (e, n1, 1) and w2_scale.shape == (e, dim, 1), "per-row scales [E, N, 1]"
        return w1f * w1_scale, w2f * w2_scale, inter, (dim, inter)
    # per_128x128, run as per_1x128: the torch reference views the weights in whole 128 x 128 blocks
    assert dim % 128 == 0 and inter % 128 == 0, "per_128x128: H and I whole 128-blocks"
    assert w1_scale.shape == (e, n1 // 128, dim // 128) and w2_scale.shape == (e, dim // 128, inter // 128)
    blocks = lambda s: s.repeat_interleave(128, 1).repeat_interleave(128, 2)  # noqa: E731
    return w1f * blocks(w1_scale), w2f * blocks(w2_scale), inter, (128, 128)


def fused_moe_quantised(qt, at, *, hidden_states, w1, w2, topk_weight, topk_ids, expert_mask, activation,
                        quant_type, doweight_stage1, w1_scale, w2_scale, a1_scale, a2_scale, block_size_M,
                        num_local_tokens, moe_sorting_dispatch_policy, dtype, hidden_pad, intermediate_pad, bias1,
                        bias2, splitk, swiglu_limit, beta, linear_beta, gate_mode, shared_w1, shared_w2,
                        shared_w1_scale, shared_w2_scale, shared_expert_id, stage2_scatter):  # fmt: skip
    """fused_moe with quantised g1u1 experts; `qt`, `at`: the stand-in's QuantType, ActivationType."""
    CALLS.append("fused_moe")
    assert quant_type in (qt.per_Token, qt.per_128x128, qt.per_1x32), f"the stand-in runs no {quant_type}"
    assert a1_scale is None and a2_scale is None, "dynamic activation scales (a1_scale None)"
    assert not doweight_stage1 and dtype is None and hidden_pad == 0 and intermediate_pad == 0 and splitk == 0
    assert num_local_tokens is None and stage2_scatter is None and gate_mode == "separated"
    assert shared_w1 is None and shared_w2 is None and shared_expert_id == -1 and beta is None
    assert getattr(w1, "is_shuffled", False) and getattr(w2, "is_shuffled", False), (
        "weights tagged is_shuffled, as shuffle_weight tags its output (fused_moe reads the tag)"
    )
    m, dim = hidden_states.shape
    assert hidden_states.dtype in HALF and hidden_states.is_contiguous(), "Fused_moe unsupported out dtype"
    assert topk_weight.dtype == torch.float32 and topk_ids.dtype == torch.int32
    assert topk_weight.shape == topk_ids.shape and topk_ids.shape[0] == m
    e = w1.shape[0]
    if quant_type == qt.per_1x32:
        assert activation == at.Swiglu, "the stand-in runs MXFP4 experts with GPT-OSS's Swiglu"
        assert m < SWIGLU_MXFP4_BF16_BOUND, f"{m} tokens: fused_moe would quantise Swiglu's activations to MXFP4"
        w1f, w2f, inter = _mxfp4_experts(w1, w2, w1_scale, w2_scale, dim, bias1, bias2)
        groups = None
    else:
        assert activation == at.Silu and bias1 is None and bias2 is None and swiglu_limit is None
        w1f, w2f, inter, groups = _fp8_experts(quant_type, qt, w1, w2, w1_scale, w2_scale, dim)
    rows = expert_rows(topk_ids, expert_mask, e)
    out = torch.zeros(m, dim, dtype=torch.float32)
    token, slot = torch.nonzero(rows >= 0, as_tuple=True)
    for t, s in zip(token.tolist(), slot.tolist(), strict=True):  # one (token, expert) pair at a time
        r = int(rows[t, s])
        x = hidden_states[t].float()
        if groups is not None:  # a8w8: the stage-1 input quantised
            x = _quantised(x, groups[0])
        h = x @ w1f[r].T + (0 if bias1 is None else bias1[r])
        gate, up = h[:inter], h[inter:]
        a = _swiglu(gate, up, swiglu_limit) if groups is None else F.silu(gate) * up
        a = a.to(hidden_states.dtype).float()  # the stage-1 output buffer is in the model dtype
        if groups is not None:  # and the stage-2 input quantised
            a = _quantised(a, groups[1])
        y = (a @ w2f[r].T + (0 if bias2 is None else bias2[r])).to(hidden_states.dtype).float()
        out[t] += topk_weight[t, s] * y
    return out.to(hidden_states.dtype)


def with_quantised_experts(unquantised, qt, at):
    """The stand-in's fused_moe: `unquantised` (fake_aiter.fused_moe) for QuantType.No, else the above."""

    def fused_moe(
        *, hidden_states, w1, w2, topk_weight, topk_ids, expert_mask=None, activation=at.Silu, quant_type=qt.No,
        doweight_stage1=False, w1_scale=None, w2_scale=None, a1_scale=None, a2_scale=None, block_size_M=None,
        num_local_tokens=None, moe_sorting_dispatch_policy=0, dtype=None, hidden_pad=0, intermediate_pad=0,
        bias1=None, bias2=None, splitk=0, swiglu_limit=None, beta=None, linear_beta=None, gate_mode="separated",
        shared_w1=None, shared_w2=None, shared_w1_scale=None, shared_w2_scale=None, shared_expert_id=-1,
        stage2_scatter=None,
    ):  # fmt: skip
        kw = {k: v for k, v in locals().items() if k not in ("unquantised", "qt", "at")}
        assert isinstance(quant_type, qt) and isinstance(activation, at), "AITER's enums"
        if quant_type == qt.No:
            return unquantised(**kw)
        return fused_moe_quantised(qt, at, **kw)

    return fused_moe


# ---- aiter/ops/gemm_op_a8w8.py: GEMMs over pre-shuffled weights ----


def _shuffled_fp8_weight(XQ, WQ):
    fp8 = fake_aiter_fp8.fp8()
    assert XQ.dim() == WQ.dim() == 2 and XQ.dtype == WQ.dtype == fp8, f"XQ [M, K], WQ [N, K] in dtypes.fp8 ({fp8})"
    assert WQ.shape[1] >= XQ.shape[1], "gemm_a8w8_bpreshuffle requires WQ K >= XQ K"
    assert WQ.shape[1] == XQ.shape[1], "the stand-in reads unpadded weights"
    return unshuffle_weight(WQ).view(fp8).float()


def gemm_a8w8_bpreshuffle(*, XQ, WQ, x_scale, w_scale, bias=None, dtype=torch.bfloat16, check=False):
    """gemm_a8w8_bpreshuffle (gemm_op_a8w8.py:695): WQ in shuffle_weight(layout=(16, 16)) order,
    per-row scales x_scale [M, 1], w_scale [N, 1] fp32; bf16/fp16 out; no bias."""
    CALLS.append("gemm_a8w8_bpreshuffle")
    assert dtype in HALF, f"Output {dtype=} is currently not supported in gemm_a8w8"
    assert bias is None, "gemm_a8w8_bpreshuffle does not support bias now"
    w = _shuffled_fp8_weight(XQ, WQ)
    m, n = XQ.shape[0], WQ.shape[0]
    assert x_scale.shape == (m, 1) and w_scale.shape == (n, 1), f"{x_scale.shape} {w_scale.shape}"
    assert x_scale.dtype == w_scale.dtype == torch.float32 and x_scale.is_contiguous() and w_scale.is_contiguous()
    return ((XQ.float() * x_scale) @ (w * w_scale).T).to(dtype)


def gemm_a8w8_blockscale_bpreshuffle(*, XQ, WQ, x_scale, w_scale, dtype=torch.bfloat16, out=None):
    """gemm_a8w8_blockscale_bpreshuffle (gemm_op_a8w8.py:909): WQ shuffled as above, 128 x 128 weight
    blocks w_scale [ceil(N/128), K/128] fp32, and x_scale column-major: [K/128, M] in memory viewed as
    [M, K/128] (ATOM allocates it so for this GEMM; AITER's quant writes it with transpose_scale)."""
    CALLS.append("gemm_a8w8_blockscale_bpreshuffle")
    assert dtype in HALF, f"Output {dtype=} is currently not supported in gemm_a8w8"
    w = _shuffled_fp8_weight(XQ, WQ)
    (m, k), n = XQ.shape, WQ.shape[0]
    assert k % 128 == 0, "activation groups of 128"
    sk = k // 128
    assert x_scale.shape == (m, sk) and x_scale.is_contiguous() and x_scale.dtype == torch.float32
    assert w_scale.shape == (-(-n // 128), sk) and w_scale.dtype == torch.float32
    xs = x_scale.reshape(-1).view(sk, m).T  # column-major
    x = XQ.float() * xs.repeat_interleave(128, 1)
    w = w * w_scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)
    y = (x @ w.T).to(dtype)
    if out is not None:
        assert out.shape == (m, n) and out.dtype == dtype
        out.copy_(y)
        return out
    return y


def extend(mod) -> None:
    """Put these on the stand-in module `mod` (fake_aiter.module())."""
    mod.dtypes.fp4x2, mod.dtypes.fp8_e8m0 = FP4X2, FP8_E8M0
    mod.gemm_a8w8_bpreshuffle = gemm_a8w8_bpreshuffle
    mod.gemm_a8w8_blockscale_bpreshuffle = gemm_a8w8_blockscale_bpreshuffle
    sub = mod.fused_moe
    sub.fused_moe = with_quantised_experts(sub.fused_moe, mod.QuantType, mod.ActivationType)
    sub._SWIGLU_MXFP4_BF16_BOUND = SWIGLU_MXFP4_BF16_BOUND
