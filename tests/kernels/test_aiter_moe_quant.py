"""`atomc_aiter::moe_quant` against the `atomc::moe_quant` reference, through the stand-in `aiter`
(tests/kernels/fake_aiter_shuffled.py: keyword-only, AITER's argument names and QuantTypes, the
shuffled layouts checked by unshuffling them): the three quantised formats, the expert map, the
batch slicing that keeps MXFP4 activations unquantised, what goes to ROCm's next backend, the
layouts against the stand-in's copy of AITER's shuffles, and the reference reading the
`_shuffled` formats. CPU only: none of this has run on AMD hardware.

Tolerances: MXFP4 (a16w4) is the reference's math, GEMMs in fp32 against the reference's in the
model dtype: one or two roundings of that dtype. FP8 runs W8A8 on AITER, the reference weight-only:
each GEMM input is rounded to e4m3 (relative 2^-4 at worst, about 3.6% RMS), so the outputs differ
by a few percent RMS of their size (measured 3.5-4.6%); a wiring error (a scale on the wrong rows, a
weight read unshuffled, gate and up swapped) moves them by their whole size."""

from __future__ import annotations

import sys

import fake_aiter
import fake_aiter_shuffled as fs
import pytest
import torch

from atomc import platforms
from atomc.kernels import registry
from atomc.ops import aiter_layout as al
from atomc.ops.fp8 import fn_to_fnuz
from atomc.ops.moe_quant import FP8_BLOCK
from models.quant.fp8 import quantize_per_row
from models.quant.mxfp4 import quantize_mxfp4

E, K, T = 8, 2, 13
FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz


@pytest.fixture(params=[FN, FNUZ], ids=["mi350-fn", "mi300-fnuz"])
def aiter_moe_quant(request, monkeypatch):
    fake_aiter.install(monkeypatch, fp8=request.param)
    # ROCm without Triton: the next backend after AITER is the reference (as on this CPU)
    monkeypatch.setattr(registry, "backend_available", lambda backend: backend != "triton")
    registry.lookup("moe_quant", "aiter")  # defines torch.ops.atomc_aiter.moe_quant and sets its fallback
    return torch.ops.atomc_aiter.moe_quant, request.param


def per_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (e4m3fn, scales [E, N/128, K/128]): amax / 448 per 128 x 128 block."""
    e, n, k = w.shape
    blocks = w.view(e, n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)
    scale = (blocks.abs().amax(dim=(2, 4)) / 448.0).clamp(min=1e-12)
    q = (blocks / scale[:, :, None, :, None]).to(FN).view(e, n, k)
    return q, scale


def fp8_experts(fmt: str, h: int, inter: int, seed=0, e=E):
    """Row-major (w13, s13, w2, s2) of `fmt` ("fp8_channel" / "fp8_block")."""
    g = torch.Generator().manual_seed(seed)
    w13, w2 = torch.randn(e, 2 * inter, h, generator=g) * 0.2, torch.randn(e, h, inter, generator=g) * 0.2
    if fmt == "fp8_block":
        return (*per_block(w13), *per_block(w2))
    q13, s13 = zip(*(quantize_per_row(w13[x]) for x in range(e)), strict=True)
    q2, s2 = zip(*(quantize_per_row(w2[x]) for x in range(e)), strict=True)
    return torch.stack(q13), torch.stack(s13), torch.stack(q2), torch.stack(s2)


def for_aiter(fmt, fp8, w13, s13, w2, s2):
    """The experts as the loader lays them out for AITER (models/quant/aiter.py), for FP8 formats."""
    if fp8 == FNUZ:
        (w13, s13), (w2, s2) = fn_to_fnuz(w13, s13), fn_to_fnuz(w2, s2)
    return al.shuffle_16x16(w13), s13, al.shuffle_16x16(w2), s2


def mxfp4_experts(h, inter, seed=0, e=E):
    """Row-major (w13 blocks, scales, w2 blocks, scales), their AITER layout, and fp32 biases."""
    g = torch.Generator().manual_seed(seed)
    b13, s13 = quantize_mxfp4(torch.randn(e, 2 * inter, h, generator=g) * 0.2)
    b2, s2 = quantize_mxfp4(torch.randn(e, h, inter, generator=g) * 0.2)
    bias13, bias2 = torch.randn(e, 2 * inter, generator=g) * 0.3, torch.randn(e, h, generator=g) * 0.3
    return (b13, s13, b2, s2), mxfp4_for_aiter(b13, s13, b2, s2), bias13, bias2


def mxfp4_for_aiter(b13, s13, b2, s2):
    """MXFP4 experts whose H and I are multiples of 256, as the loader lays them out for AITER."""
    scales = lambda s: al.shuffle_e8m0(s.reshape(-1, s.shape[-1])).view(s.shape)  # noqa: E731
    return al.shuffle_16x16(b13), scales(s13), al.shuffle_16x16(b2), scales(s2)


def tokens(h, dtype, t=T, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, h, generator=g).to(dtype), torch.randn(t, E, generator=g).to(dtype)


def call(op, x, logits, experts, fmt, b13=None, b2=None, expert_map=None, **kw):
    return op(x, logits, *experts, b13, b2, expert_map, None, K, fmt, **kw)


SWIGLU = dict(activation="swiglu_oai", swiglu_alpha=1.702, swiglu_limit=7.0)


# ---- the layouts ----


@pytest.mark.parametrize("dtype", [torch.uint8, FN, FNUZ])
def test_shuffle_is_aiters_shuffle_weight(dtype):
    """atomc's shuffle_16x16 writes what the stand-in's copy of aiter.ops.shuffle.shuffle_weight
    writes, for every one-byte dtype atomc shuffles, and its inverse reads it back."""
    w = torch.randint(0, 256, (3, 48, 96), dtype=torch.uint8).view(dtype)
    want = fs.shuffle_weight(w, layout=(16, 16))
    got = al.shuffle_16x16(w)
    assert got.dtype == dtype and got.shape == w.shape
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(al.unshuffle_16x16(got).view(torch.uint8), w.view(torch.uint8))
    assert torch.equal(fs.unshuffle_weight(got), w.view(torch.uint8))
    with pytest.raises(ValueError, match="N % 16"):
        al.shuffle_16x16(w[:, :40])


def test_e8m0_shuffle_is_aiters_shuffle_scale():
    s = torch.randint(0, 256, (512, 24), dtype=torch.uint8)
    assert torch.equal(al.shuffle_e8m0(s), fs.shuffle_scale(s))
    assert torch.equal(al.unshuffle_e8m0(al.shuffle_e8m0(s)), s)
    assert not torch.equal(al.shuffle_e8m0(s), s)
    with pytest.raises(ValueError, match="256"):
        al.shuffle_e8m0(s[:480])  # AITER would pad it: atomc lays out only what needs no padding


@pytest.mark.skipif(not platforms.aiter_importable(), reason="the installed AITER: ROCm only")
def test_layouts_are_the_installed_aiters():
    """On a machine with AITER: atomc's permutations against AITER's own functions (the stand-in's
    copies are from its source at one commit; this pins them to the installed release)."""
    from aiter.ops.shuffle import shuffle_scale, shuffle_weight

    w = torch.randint(0, 256, (3, 48, 96), dtype=torch.uint8)
    assert torch.equal(al.shuffle_16x16(w), shuffle_weight(w, layout=(16, 16)).view(torch.uint8))
    s = torch.randint(0, 256, (512, 24), dtype=torch.uint8)
    assert torch.equal(al.shuffle_e8m0(s), shuffle_scale(s).view(torch.uint8))


@pytest.mark.parametrize("fmt", ["fp8_channel", "fp8_block", "mxfp4"])
def test_reference_reads_the_shuffled_formats(fmt):
    """atomc::moe_quant on a `_shuffled` format computes exactly what it does on the row-major one
    (an eager run, or a call AITER declines, reads the loader's layout through the inverses)."""
    h, inter = (256, 128) if fmt == "fp8_block" else (256, 256)
    x, logits = tokens(h, torch.float32)
    if fmt == "mxfp4":
        row_major, shuffled, b13, b2 = mxfp4_experts(h, inter)
        kw = SWIGLU
    else:
        row_major = fp8_experts(fmt, h, inter)
        shuffled, b13, b2, kw = for_aiter(fmt, FNUZ, *row_major), None, None, {}
    want = call(torch.ops.atomc.moe_quant, x, logits, row_major, fmt, b13, b2, **kw)
    got = call(torch.ops.atomc.moe_quant, x, logits, shuffled, f"{fmt}_shuffled", b13, b2, **kw)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # fnuz and its doubled scales: same values


# ---- the op ----


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["fp8_channel", "fp8_block"])
def test_fp8_experts_match_the_reference(aiter_moe_quant, fmt, dtype):
    op, fp8 = aiter_moe_quant
    h, inter = (256, 128) if fmt == "fp8_block" else (64, 32)
    x, logits = tokens(h, dtype)
    row_major = fp8_experts(fmt, h, inter)
    got = call(op, x, logits, for_aiter(fmt, fp8, *row_major), f"{fmt}_shuffled")
    want = call(torch.ops.atomc.moe_quant, x, logits, row_major, fmt)
    assert got.dtype == dtype and got.shape == (T, h)
    assert fake_aiter.CALLS == ["topk_softmax", "fused_moe"]
    assert_w8a8_close(got, want)


def assert_w8a8_close(got, want):
    """W8A8 against weight-only (module docstring): measured 3.5-4.6% RMS of the output's RMS, a
    wiring error 100% or more."""
    err = (got.float() - want.float()).pow(2).mean().sqrt() / want.float().pow(2).mean().sqrt()
    assert err < 0.08, f"RMS difference {err:.3f} of the output's RMS"


def test_fp8_quant_types_reach_fused_moe(aiter_moe_quant, monkeypatch):
    """per_Token for per-row scales, per_128x128 for blocks; scales as fused_moe's signature has them."""
    op, fp8 = aiter_moe_quant
    seen = []
    real = sys.modules["aiter.fused_moe"].fused_moe
    monkeypatch.setattr(sys.modules["aiter.fused_moe"], "fused_moe", lambda **kw: seen.append(kw) or real(**kw))
    mod = sys.modules["aiter"]
    for fmt, (h, inter), quant_type in (("fp8_channel", (64, 32), mod.QuantType.per_Token),
                                        ("fp8_block", (256, 128), mod.QuantType.per_128x128)):  # fmt: skip
        x, logits = tokens(h, torch.bfloat16)
        call(op, x, logits, for_aiter(fmt, fp8, *fp8_experts(fmt, h, inter)), f"{fmt}_shuffled")
        kw = seen.pop()
        assert kw["quant_type"] == quant_type and kw["activation"] == mod.ActivationType.Silu
        assert kw["a1_scale"] is None and kw["a2_scale"] is None  # fused_moe quantises the activations
        assert kw["w1"].dtype == fp8 and kw["w1"].is_shuffled and kw["w2"].is_shuffled
        if fmt == "fp8_channel":
            assert kw["w1_scale"].shape == (E, 2 * inter, 1) and kw["w2_scale"].shape == (E, h, 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("biases", [True, False])
def test_mxfp4_swiglu_matches_the_reference(aiter_moe_quant, dtype, biases):
    op, _ = aiter_moe_quant
    h, inter = 256, 256
    x, logits = tokens(h, dtype)
    row_major, shuffled, b13, b2 = mxfp4_experts(h, inter)
    b13, b2 = (b13, b2) if biases else (None, None)
    got = call(op, x, logits, shuffled, "mxfp4_shuffled", b13, b2, **SWIGLU)  # fp32 biases, as loaded for AITER
    want = call(torch.ops.atomc.moe_quant, x, logits, row_major, "mxfp4",
                *(None if b is None else b.to(dtype) for b in (b13, b2)), **SWIGLU)  # fmt: skip
    assert fake_aiter.CALLS == ["topk_softmax", "fused_moe"]
    tol = 2e-3 if dtype == torch.float16 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol * want.float().abs().max().item(), rtol=tol)


def test_mxfp4_padded_experts_cut_back_to_h(aiter_moe_quant):
    """The loader pads H (and I) to multiples of 256 with zero experts: x is padded for fused_moe and
    the output cut back to H; the values are the unpadded experts'."""
    op, _ = aiter_moe_quant
    h, inter, hp = 64, 256, 256
    x, logits = tokens(h, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    b13, s13 = quantize_mxfp4(torch.randn(E, 2 * inter, h, generator=g) * 0.2)
    b2, s2 = quantize_mxfp4(torch.randn(E, h, inter, generator=g) * 0.2)
    bias13, bias2 = torch.randn(E, 2 * inter, generator=g) * 0.3, torch.randn(E, h, generator=g) * 0.3
    cols = lambda t, n, fill: torch.cat([t, t.new_full((*t.shape[:-1], n), fill)], -1)  # noqa: E731
    rows = lambda t, n, fill: torch.cat([t, t.new_full((E, n, *t.shape[2:]), fill)], 1)  # noqa: E731
    padded = (cols(b13, (hp - h) // 2, 0), cols(s13, (hp - h) // 32, 127), rows(b2, hp - h, 0), rows(s2, hp - h, 127))
    b2p = rows(bias2, hp - h, 0.0)
    shuffled = mxfp4_for_aiter(*padded)
    got = call(op, x, logits, shuffled, "mxfp4_shuffled", bias13, b2p, **SWIGLU)
    want = call(torch.ops.atomc.moe_quant, x, logits, (b13, s13, b2, s2), "mxfp4", bias13.bfloat16(),
                bias2.bfloat16(), **SWIGLU)  # fmt: skip
    assert got.shape == (T, h)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * want.float().abs().max().item(), rtol=2e-2)
    ref = call(torch.ops.atomc.moe_quant, x, logits, shuffled, "mxfp4_shuffled", bias13, b2p, **SWIGLU)
    torch.testing.assert_close(ref.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_mxfp4_batches_are_sliced_below_the_bf16_bound(aiter_moe_quant):
    """From 256 tokens fused_moe would quantise GPT-OSS's activations to MXFP4 (the stand-in refuses):
    600 tokens go as slices of 255, 255 and 90, and give the reference's values."""
    op, _ = aiter_moe_quant
    h, inter = 256, 256
    x, logits = tokens(h, torch.bfloat16, t=600)
    row_major, shuffled, _, _ = mxfp4_experts(h, inter, e=E)
    got = call(op, x, logits, shuffled, "mxfp4_shuffled", **SWIGLU)
    want = call(torch.ops.atomc.moe_quant, x, logits, row_major, "mxfp4", **SWIGLU)
    assert fake_aiter.CALLS == ["topk_softmax"] + ["fused_moe"] * 3
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2 * want.float().abs().max().item(), rtol=2e-2)


def test_expert_map_through_the_expert_mask(aiter_moe_quant):
    op, fp8 = aiter_moe_quant
    expert_map = torch.tensor([-1, 2, -1, 0, 3, -1, 1, -1], dtype=torch.int32)
    h, inter = 64, 32
    x, logits = tokens(h, torch.bfloat16)
    row_major = fp8_experts("fp8_channel", h, inter, seed=4, e=4)
    got = call(op, x, logits, for_aiter("fp8_channel", fp8, *row_major), "fp8_channel_shuffled", expert_map=expert_map)
    want = call(torch.ops.atomc.moe_quant, x, logits, row_major, "fp8_channel", expert_map=expert_map)
    assert_w8a8_close(got, want)
    assert fake_aiter.CALLS == ["topk_softmax", "fused_moe"]


@pytest.mark.parametrize("case", ["row_major", "fp8_silu_biases", "fp8_swiglu", "mxfp4_silu", "float32",
                                  "fp8_wrong_e4m3"])  # fmt: skip
def test_what_aiter_cannot_run_goes_to_the_next_backend(aiter_moe_quant, case):
    """Row-major experts (not laid out at load), biases or SwiGLU on FP8 experts, SiLU on MXFP4
    (fused_moe would quantise its activations to MXFP4), fp32, FP8 weights not in this GPU's e4m3:
    the reference here (ROCm without Triton), no AITER call."""
    op, fp8 = aiter_moe_quant
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    kw, b13, b2 = {}, None, None
    if case.startswith("mxfp4"):
        h, inter = 256, 256
        _, experts, _, _ = mxfp4_experts(h, inter)
        fmt = "mxfp4_shuffled"
    else:
        h, inter = 64, 32
        row_major = fp8_experts("fp8_channel", h, inter)
        experts, fmt = for_aiter("fp8_channel", fp8, *row_major), "fp8_channel_shuffled"
        if case == "row_major":
            experts, fmt = row_major, "fp8_channel"
        if case == "fp8_wrong_e4m3":
            experts = for_aiter("fp8_channel", FNUZ if fp8 == FN else FN, *row_major)
        if case == "fp8_silu_biases":
            b13, b2 = torch.zeros(E, 2 * inter, dtype=dtype), torch.zeros(E, h, dtype=dtype)
        if case == "fp8_swiglu":
            kw = SWIGLU
    x, logits = tokens(h, dtype)
    got = call(op, x, logits, experts, fmt, b13, b2, **kw)
    assert torch.equal(got, call(torch.ops.atomc.moe_quant, x, logits, experts, fmt, b13, b2, **kw))
    assert fake_aiter.CALLS == []


def test_no_tokens(aiter_moe_quant):
    op, fp8 = aiter_moe_quant
    x, logits = tokens(64, torch.bfloat16, t=0)
    experts = for_aiter("fp8_channel", fp8, *fp8_experts("fp8_channel", 64, 32))
    out = call(op, x, logits, experts, "fp8_channel_shuffled")
    assert out.shape == (0, 64) and fake_aiter.CALLS == []


def test_stand_in_refuses_what_aiter_refuses(monkeypatch):
    mod = fake_aiter.install(monkeypatch)
    h, inter = 64, 32
    q13, s13, q2, s2 = fp8_experts("fp8_channel", h, inter)
    w13, w2 = fs.shuffle_weight(q13), fs.shuffle_weight(q2)
    x, _ = tokens(h, torch.bfloat16)
    ids = torch.zeros(T, K, dtype=torch.int32)
    ok = dict(hidden_states=x, w1=w13, w2=w2, topk_weight=torch.ones(T, K), topk_ids=ids,
              activation=mod.ActivationType.Silu, quant_type=mod.QuantType.per_Token,
              w1_scale=s13.unsqueeze(-1), w2_scale=s2.unsqueeze(-1))  # fmt: skip
    mod.fused_moe.fused_moe(**ok)
    for bad in (dict(w1=q13, w2=q2),  # not tagged is_shuffled
                dict(w1_scale=s13),  # per-row scales are [E, N, 1]
                dict(a1_scale=torch.ones(1)),  # static activation scales: atomc passes None
                dict(quant_type=mod.QuantType.per_Tensor), dict(activation=mod.ActivationType.Swiglu)):  # fmt: skip
        with pytest.raises(AssertionError):
            mod.fused_moe.fused_moe(**{**ok, **bad})
    with pytest.raises(TypeError):
        mod.fused_moe.fused_moe(**ok, w1_scales=s13)  # a misspelt keyword
    _, (b13, sc13, b2, sc2), _, _ = mxfp4_experts(256, 256)
    x, _ = tokens(256, torch.bfloat16, t=256)
    ids = torch.zeros(256, K, dtype=torch.int32)
    mx = dict(hidden_states=x, w1=fs.shuffle_weight(b13.view(fs.FP4X2)), w2=fs.shuffle_weight(b2.view(fs.FP4X2)),
              topk_weight=torch.ones(256, K), topk_ids=ids, activation=mod.ActivationType.Swiglu,
              quant_type=mod.QuantType.per_1x32, w1_scale=sc13.view(-1, 8).view(fs.FP8_E8M0),
              w2_scale=sc2.view(-1, 8).view(fs.FP8_E8M0))  # fmt: skip
    with pytest.raises(AssertionError, match="MXFP4"):
        mod.fused_moe.fused_moe(**mx)  # 256 tokens: fused_moe would quantise the activations
    fewer = dict(hidden_states=x[:255], topk_weight=torch.ones(255, K), topk_ids=ids[:255])
    mod.fused_moe.fused_moe(**{**mx, **fewer})


def test_rocm_lowers_moe_quant_to_aiter(monkeypatch):
    fake_aiter.install(monkeypatch)
    monkeypatch.setattr(registry, "backend_available", lambda backend: True)
    assert registry.choose("moe_quant", "rocm") == ("aiter", torch.ops.atomc_aiter.moe_quant.default)
    assert "atomc.kernels.aiter.moe_quant" in registry.chosen_modules("rocm")
    monkeypatch.setattr(registry, "backend_available", lambda backend: backend == "torch")
    assert registry.choose("moe_quant", "rocm")[0] == "torch"
