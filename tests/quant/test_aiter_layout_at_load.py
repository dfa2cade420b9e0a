"""The load-time layout of quantised weights for AITER (models/quant/aiter.py), on CPU with the loader
told the device runs AITER: which experts and FP8 linears are laid out (and in which format, or
behind which GEMM op), what the tensors hold (the stand-in's own unshuffle of AITER's permutations
reads back the row-major values; MXFP4 padded to 256 with zero experts and 2^0 scales, biases fp32;
FP8 in float8_e4m3fnuz on MI300 with doubled scales), which stay row-major and why, and that
nothing changes where AITER does not run. None of this has run on AMD hardware."""

from __future__ import annotations

import pytest
import torch

from atomc import platforms
from atomc.ops.fp8 import fn_to_fnuz
from atomc.ops.moe_quant import dequantize_experts
from models.layers.linear import ReplicatedLinear
from models.layers.moe import FusedMoE, MoESpec
from models.quant.aiter import experts_decline, linear_declines
from models.quant.fp8 import FP8BlockLinearMethod, FP8LinearMethod, quantize_per_row
from models.quant.fp8_moe import Fp8MoEMethod
from models.quant.mxfp4 import Mxfp4MoEMethod, quantize_mxfp4
from models.quant.spec import FP8Scheme
from tests.kernels import fake_aiter_shuffled as fs

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
E = 4


@pytest.fixture
def gpu(monkeypatch):
    """This CPU as a ROCm GPU running AITER whose e4m3 is the given dtype."""

    def as_gpu(fp8=FN, aiter=True):
        monkeypatch.setattr(platforms, "uses_aiter", lambda device: aiter)
        monkeypatch.setattr(platforms, "fp8_dtype", lambda device: fp8)

    return as_gpu


def layer_with(method, h, inter, dtype=torch.bfloat16, activation="silu", bias=False, seed=0):
    """A FusedMoE of `method`'s experts, loaded with random row-major values."""
    g = torch.Generator().manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        spec = MoESpec(num_experts=E, top_k=2, intermediate_size=inter, activation=activation, expert_bias=bias)
        layer = FusedMoE(h, spec)
        layer.set_moe_method(method)
    finally:
        torch.set_default_dtype(old)
    w13, w2 = torch.randn(E, 2 * inter, h, generator=g) * 0.2, torch.randn(E, h, inter, generator=g) * 0.2
    if isinstance(method, Mxfp4MoEMethod):
        values = (*quantize_mxfp4(w13), *quantize_mxfp4(w2))
    elif method.weight_format == "fp8_channel":
        rows = [quantize_per_row(w[x]) for w in (w13, w2) for x in range(E)]
        values = (torch.stack([q for q, _ in rows[:E]]), torch.stack([s for _, s in rows[:E]]),
                  torch.stack([q for q, _ in rows[E:]]), torch.stack([s for _, s in rows[E:]]))  # fmt: skip
    else:
        raise ValueError(method.weight_format)
    for name, value in zip(method.params, values, strict=True):
        getattr(layer, name).data.copy_(value)
    if bias:
        layer.w13_bias.data.copy_(torch.randn(E, 2 * inter, generator=g))
        layer.w2_bias.data.copy_(torch.randn(E, h, generator=g))
    return layer


def row_major(layer):
    return tuple(getattr(layer, n).data.clone() for n in layer.moe_method.params)


def fp8_channel():
    return Fp8MoEMethod(FP8Scheme(weight="channel", activation="token"))


@pytest.mark.parametrize("fp8", [FN, FNUZ], ids=["mi350", "mi300"])
def test_fp8_experts_are_shuffled_and_moved_to_the_gpus_e4m3(gpu, fp8):
    gpu(fp8)
    layer = layer_with(fp8_channel(), 64, 32)
    w13, s13, w2, s2 = row_major(layer)
    layer.moe_method.process_weights_after_loading(layer)
    assert layer.moe_method.weight_format == "fp8_channel_shuffled"
    got13, got_s13 = layer.w13_weight.data, layer.w13_weight_scale.data
    assert got13.dtype == fp8 and got13.shape == w13.shape and got_s13.shape == s13.shape
    values = fs.unshuffle_weight(got13).view(fp8).float() * got_s13[..., None]
    assert torch.equal(values, w13.float() * s13[..., None])  # the same values, AITER's layout
    assert torch.equal(got_s13, s13 * (2.0 if fp8 == FNUZ else 1.0))
    assert torch.equal(dequantize_experts(layer.w2_weight, layer.w2_weight_scale, "fp8_channel_shuffled",
                                          torch.float32), w2.float() * s2[..., None])  # fmt: skip


def test_mxfp4_experts_are_padded_and_shuffled(gpu):
    gpu()
    h, inter = 64, 96
    layer = layer_with(Mxfp4MoEMethod(), h, inter, activation="swiglu_oai", bias=True)
    b13, s13, b2, s2 = row_major(layer)
    bias13, bias2 = layer.w13_bias.data.clone(), layer.w2_bias.data.clone()
    layer.moe_method.process_weights_after_loading(layer)
    assert layer.moe_method.weight_format == "mxfp4_shuffled"
    assert layer.w13_blocks.shape == (E, 512, 128) and layer.w13_scales.shape == (E, 512, 8)
    assert layer.w2_blocks.shape == (E, 256, 128) and layer.w2_scales.shape == (E, 256, 8)
    blocks13 = fs.unshuffle_weight(layer.w13_blocks).view(E, 512, 128)
    scales13 = fs.unshuffle_scale(layer.w13_scales.reshape(-1, 8)).view(E, 512, 8)
    # gate rows [0, I), up rows [256, 256 + I); zeros and 2^0 scales elsewhere
    assert torch.equal(blocks13[:, :inter, : h // 2], b13[:, :inter])
    assert torch.equal(blocks13[:, 256 : 256 + inter, : h // 2], b13[:, inter:])
    assert torch.equal(scales13[:, 256 : 256 + inter, : h // 32], s13[:, inter:])
    assert blocks13[:, inter:256].eq(0).all() and blocks13[:, :, h // 2 :].eq(0).all()
    assert scales13[:, inter:256].eq(127).all() and scales13[:, :, h // 32 :].eq(127).all()
    blocks2 = fs.unshuffle_weight(layer.w2_blocks).view(E, 256, 128)
    scales2 = fs.unshuffle_scale(layer.w2_scales.reshape(-1, 8)).view(E, 256, 8)
    assert torch.equal(blocks2[:, :h, : inter // 2], b2) and torch.equal(scales2[:, :h, : inter // 32], s2)
    assert layer.w13_bias.dtype == layer.w2_bias.dtype == torch.float32
    assert torch.equal(layer.w13_bias[:, :inter], bias13[:, :inter].float())
    assert torch.equal(layer.w13_bias[:, 256 : 256 + inter], bias13[:, inter:].float())
    assert layer.w13_bias[:, inter:256].eq(0).all() and torch.equal(layer.w2_bias[:, :h], bias2.float())


@pytest.mark.parametrize(
    "case,why",
    [
        ("mxfp4_on_mi300", "MI300"),
        ("mxfp4_silu", "GPT-OSS's SwiGLU"),
        ("fp8_biases", "biases"),
        ("fp8_float32", "fp16/bf16"),
        ("fp8_width", "K % 32"),
    ],
)
def test_what_aiter_does_not_take_stays_row_major(gpu, case, why):
    gpu(FNUZ if case == "mxfp4_on_mi300" else FN)
    if case.startswith("mxfp4"):
        act = "silu" if case == "mxfp4_silu" else "swiglu_oai"
        layer = layer_with(Mxfp4MoEMethod(), 64, 64, activation=act, bias=case != "mxfp4_silu")
    else:
        h, inter = (64, 48) if case == "fp8_width" else (64, 32)
        dtype = torch.float32 if case == "fp8_float32" else torch.bfloat16
        layer = layer_with(fp8_channel(), h, inter, dtype=dtype, bias=case == "fp8_biases")
    fmt, before = layer.moe_method.weight_format, row_major(layer)
    assert why in experts_decline(layer, fmt)
    layer.moe_method.process_weights_after_loading(layer)
    assert layer.moe_method.weight_format == fmt
    assert all(torch.equal(a, b) for a, b in zip(row_major(layer), before, strict=True))


def test_nothing_changes_where_aiter_does_not_run(gpu):
    gpu(FNUZ, aiter=False)  # ROCm without AITER (or CUDA, CPU): row-major e4m3fn experts, as before
    layer = layer_with(fp8_channel(), 64, 32)
    before = row_major(layer)
    layer.moe_method.process_weights_after_loading(layer)
    assert layer.moe_method.weight_format == "fp8_channel" and layer.w13_weight.dtype == FN
    assert all(torch.equal(a, b) for a, b in zip(row_major(layer), before, strict=True))


# ---- FP8 linears ----


def linear_with(method, n, k, dtype=torch.bfloat16, seed=0):
    """A ReplicatedLinear of `method`, loaded with a random row-major e4m3 weight and its scales."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = ReplicatedLinear(k, n, linear_method=method)
    finally:
        torch.set_default_dtype(old)
    g = torch.Generator().manual_seed(seed)
    layer.weight.data.copy_((torch.randn(n, k, generator=g) * 4).to(FN))
    scale = layer.weight_scale if hasattr(layer, "weight_scale") else layer.weight_scale_inv
    scale.data.copy_(torch.rand(scale.shape, generator=g) + 0.5)
    return layer


@pytest.mark.parametrize("fp8", [FN, FNUZ], ids=["mi350", "mi300"])
@pytest.mark.parametrize("block", [False, True])
def test_fp8_linear_weights_are_shuffled_and_the_gemm_says_so(gpu, fp8, block):
    gpu(fp8)
    if block:
        method, n, k = FP8BlockLinearMethod(FP8Scheme(weight="block", activation="group", block=(128, 128))), 256, 384
    else:
        method, n, k = FP8LinearMethod(FP8Scheme(weight="channel", activation="token")), 96, 64
    layer = linear_with(method, n, k)
    w = layer.weight.data.clone()
    method.process_weights_after_loading(layer)
    assert method.shuffled and layer.weight.shape == (n, k) and layer.weight.dtype == fp8
    moved = fn_to_fnuz(w, torch.ones(1))[0] if fp8 == FNUZ else w
    assert torch.equal(fs.unshuffle_weight(layer.weight), moved.view(torch.uint8))
    graph = torch.fx.symbolic_trace(layer).graph
    gemms = [n.target for n in graph.nodes if n.op == "call_function" and "gemm" in str(n.target)]
    want = torch.ops.atomc.fp8_block_gemm_shuffled if block else torch.ops.atomc.fp8_gemm_shuffled
    assert gemms == [want]


@pytest.mark.parametrize("case,why", [("width", "K % 32"), ("float32", "fp16/bf16"), ("no_aiter", None)])
def test_fp8_linears_aiter_does_not_take_stay_row_major(gpu, case, why):
    gpu(FN, aiter=case != "no_aiter")
    method = FP8LinearMethod(FP8Scheme(weight="channel", activation="token"))
    k = 48 if case == "width" else 64
    layer = linear_with(method, 64, k, dtype=torch.float32 if case == "float32" else torch.bfloat16)
    w = layer.weight.data.clone()
    if why:
        assert why in linear_declines(layer, None)
    method.process_weights_after_loading(layer)
    assert not method.shuffled and torch.equal(layer.weight.data.view(torch.uint8), w.view(torch.uint8))
