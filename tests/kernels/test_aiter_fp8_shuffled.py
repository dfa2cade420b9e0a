"""The FP8 GEMMs over AITER's pre-shuffled weights: the `atomc::fp8_gemm_shuffled` /
`fp8_block_gemm_shuffled` references (atomc/ops/fp8_shuffled.py) and their AITER bindings
(atomc/kernels/aiter/fp8.py) against the row-major GEMMs' reference, through the stand-in `aiter`
(tests/kernels/fake_aiter_shuffled.py: gemm_a8w8_bpreshuffle and gemm_a8w8_blockscale_bpreshuffle
with AITER's keywords, the weight unshuffled by the stand-in's own inverse of shuffle_weight, the
block GEMM's x_scale read column-major), as an MI350 and as an MI300; the calls that go to the
next backend; the registry. CPU only: none of this has run on AMD hardware.

Tolerance: the same quantised operands on both sides, so only fp32 summation order and the
fp16/bf16 output rounding differ (rtol 1e-2, as test_aiter_fp8.py)."""

import fake_aiter
import pytest
import torch

from atomc.kernels import registry
from atomc.ops import aiter_layout as al
from atomc.ops import fp8 as ref

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz


@pytest.fixture(params=[FN, FNUZ], ids=["mi350-fn", "mi300-fnuz"])
def aiter_ops(request, monkeypatch):
    torch.manual_seed(0)
    fake_aiter.install(monkeypatch, fp8=request.param)
    registry.lookup("fp8_gemm_shuffled", "aiter")  # defines torch.ops.atomc_aiter.fp8_* and sets the fallback
    monkeypatch.setattr(registry, "backend_available", lambda backend: backend != "triton")
    fake_aiter.CALLS.clear()
    return torch.ops.atomc_aiter, request.param


def weight(n, k, fp8, per_row=True):
    """(e4m3 weight [N, K] in `fp8`, scale [N] or [1]) as the loader holds it, row-major."""
    w = torch.randn(n, k) * 0.1
    scale = (w.abs().amax(1) if per_row else w.abs().amax().reshape(1)) / 448.0
    q = (w / (scale[:, None] if per_row else scale)).to(FN)
    return ref.fn_to_fnuz(q, scale) if fp8 == FNUZ else (q, scale)


def block_weight(n, k, fp8):
    w = torch.randn(n, k) * 0.1
    blocks = w.view(n // 128, 128, k // 128, 128)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    q = (blocks / scale[:, None, :, None]).to(FN).view(n, k)
    return ref.fn_to_fnuz(q, scale) if fp8 == FNUZ else (q, scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme", ["token-channel", "tensor-tensor", "static-channel-bias"])
def test_shuffled_gemm_matches_the_reference(aiter_ops, dtype, scheme):
    ops, fp8 = aiter_ops
    n, k = 96, 64
    x = torch.randn(3, 5, k).to(dtype)
    q, w_scale = weight(n, k, fp8, per_row=scheme != "tensor-tensor")
    bias = torch.randn(n).to(dtype) if scheme.endswith("bias") else None
    if scheme.startswith("static"):
        x_scale = torch.tensor([0.02])
        xq = ops.fp8_quant_static(x, x_scale)
    else:
        xq, x_scale = ops.fp8_quant_dynamic(x, k if scheme.startswith("token") else 0)
    fake_aiter.CALLS.clear()
    got = ops.fp8_gemm_shuffled(xq, x_scale, al.shuffle_16x16(q), w_scale, bias, dtype)
    assert fake_aiter.CALLS == ["gemm_a8w8_bpreshuffle"]
    want = ref.fp8_gemm_reference(xq, x_scale, q, w_scale, bias, dtype)
    assert got.shape == (3, 5, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * want.float().abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_shuffled_block_gemm_matches_the_reference(aiter_ops, dtype):
    """M = 7 rows and K = 384 (three groups): a row-major x_scale read as column-major would mix them."""
    ops, fp8 = aiter_ops
    n, k = 256, 384
    x = torch.randn(7, k).to(dtype) * torch.linspace(0.1, 4.0, k).to(dtype)  # groups of unequal scales
    q, w_scale = block_weight(n, k, fp8)
    xq, x_scale = ops.fp8_quant_dynamic(x, 128)
    fake_aiter.CALLS.clear()
    got = ops.fp8_block_gemm_shuffled(xq, x_scale, al.shuffle_16x16(q), w_scale, 128, 128, None, dtype)
    assert fake_aiter.CALLS == ["gemm_a8w8_blockscale_bpreshuffle"]
    want = ref.fp8_block_gemm_reference(xq, x_scale, q, w_scale, 128, 128, None, dtype)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * want.float().abs().max().item())


@pytest.mark.parametrize("block", [False, True])
def test_the_references_read_the_shuffled_weight(block):
    """atomc::fp8_*gemm_shuffled equal the row-major GEMMs on the unshuffled weight (an eager run, or a
    call AITER declines)."""
    n, k = (256, 256) if block else (48, 96)
    x = torch.randn(4, k)
    if block:
        q, w_scale = block_weight(n, k, FN)
        xq, x_scale = ref.fp8_quant_dynamic(x, 128)
        got = torch.ops.atomc.fp8_block_gemm_shuffled(xq, x_scale, al.shuffle_16x16(q), w_scale, 128, 128, None,
                                                      torch.float32)  # fmt: skip
        want = torch.ops.atomc.fp8_block_gemm(xq, x_scale, q, w_scale, 128, 128, None, torch.float32)
    else:
        q, w_scale = weight(n, k, FN)
        xq, x_scale = ref.fp8_quant_dynamic(x, k)
        got = torch.ops.atomc.fp8_gemm_shuffled(xq, x_scale, al.shuffle_16x16(q), w_scale, None, torch.float32)
        want = torch.ops.atomc.fp8_gemm(xq, x_scale, q, w_scale, None, torch.float32)
    assert torch.equal(got, want)


@pytest.mark.parametrize("case", ["fp32_out", "no_rows", "block_64"])
def test_what_aiter_does_not_take_goes_to_the_reference(aiter_ops, case):
    """The next backend of the `_shuffled` GEMMs is the reference (Triton has none): fp32 outputs, no
    rows, blocks other than 128 x 128."""
    ops, fp8 = aiter_ops
    n, k = (128, 256)
    rows = 0 if case == "no_rows" else 3
    dtype = torch.float32 if case == "fp32_out" else torch.bfloat16
    x = torch.randn(rows, k).to(torch.bfloat16)
    if case == "block_64":
        w = torch.randn(n, k) * 0.1
        q, w_scale = w.to(FN), torch.ones(n // 64, k // 64) * 0.5
        xq, x_scale = ref.fp8_quant_dynamic(x, 64)
        got = ops.fp8_block_gemm_shuffled(xq, x_scale, al.shuffle_16x16(q), w_scale, 64, 64, None, dtype)
        want = ref.fp8_block_gemm_reference(xq, x_scale, q, w_scale, 64, 64, None, dtype)
    else:
        q, w_scale = weight(n, k, fp8)
        xq, x_scale = ref.fp8_quant_dynamic(x, k)
        got = ops.fp8_gemm_shuffled(xq, x_scale, al.shuffle_16x16(q), w_scale, None, dtype)
        want = ref.fp8_gemm_reference(xq, x_scale, q, w_scale, None, dtype)
    assert fake_aiter.CALLS == [] and got.shape == want.shape
    assert torch.equal(got, want)


def test_stand_in_refuses_what_aiter_refuses(monkeypatch):
    mod = fake_aiter.install(monkeypatch)
    q, w_scale = weight(64, 64, FN)
    xq, x_scale = ref.fp8_quant_dynamic(torch.randn(4, 64), 64)
    ok = dict(XQ=xq, WQ=al.shuffle_16x16(q), x_scale=x_scale, w_scale=w_scale.reshape(-1, 1), dtype=torch.bfloat16)
    mod.gemm_a8w8_bpreshuffle(**ok)
    for bad in (dict(bias=torch.zeros(64)), dict(dtype=torch.float32), dict(w_scale=w_scale),
                dict(WQ=al.shuffle_16x16(q).view(torch.int8))):  # fmt: skip
        with pytest.raises(AssertionError):
            mod.gemm_a8w8_bpreshuffle(**{**ok, **bad})
    with pytest.raises(TypeError):
        mod.gemm_a8w8_bpreshuffle(xq, q, x_scale, w_scale)  # positional


def test_registry_lowers_the_shuffled_gemms_to_aiter_on_rocm_only(monkeypatch):
    fake_aiter.install(monkeypatch)
    monkeypatch.setattr(registry, "backend_available", lambda backend: True)
    for op in ("fp8_gemm_shuffled", "fp8_block_gemm_shuffled"):
        assert registry.choose(op, "rocm")[0] == "aiter"
        assert registry.choose(op, "cuda")[0] == "torch"  # never emitted there: the loader shuffles on ROCm only
        assert registry.lookup(op, "triton") is None
