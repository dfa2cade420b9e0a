"""The AITER FP8 bindings (atomc/kernels/aiter/fp8.py) against the stand-in `aiter`, as an MI350
(float8_e4m3fn) and as an MI300 (float8_e4m3fnuz): argument names, dtypes, shapes, the numbers, the
fn -> fnuz move and the calls AITER declines. CPU only: none of this has run on AMD hardware.

Tolerances: a quantised value is within one e4m3 rounding of its input (relative 2^-4, plus
scale * 2^-8 for values near zero, which e4m3 holds as subnormals), where the input AITER's fused
kernels quantise (fp32) may differ from the reference's (rounded to bf16) by 2^-8 relative: rtol
2^-4 + 2^-7; a GEMM's output against the
reference on the same quantised operands differs only by fp32 summation order and the fp16/bf16
output rounding (rtol 1e-2)."""

import fake_aiter
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from atomc.kernels import registry
from atomc.ops import fp8 as ref
from atomc.ops import fp8_fused
from atomc.ops.norm import rms_norm_reference

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz


@pytest.fixture(params=[FN, FNUZ], ids=["mi350-fn", "mi300-fnuz"])
def aiter_ops(request, monkeypatch):
    torch.manual_seed(0)
    fake_aiter.install(monkeypatch, fp8=request.param)
    registry.lookup("fp8_gemm", "aiter")  # defines torch.ops.atomc_aiter.fp8_* and sets the GEMMs' fallback
    # ROCm's next backend after AITER, here the reference (no Triton on this path)
    monkeypatch.setattr(registry, "backend_available", lambda backend: backend != "triton")
    fake_aiter.CALLS.clear()
    return torch.ops.atomc_aiter, request.param


def dequant(q, scale, group=None):
    s = scale.float()
    if group:
        s = s.repeat_interleave(group, -1)
    return q.float() * s


def assert_quantised(q, scale, x, dtype, group=None):
    """q is in `dtype` and q * scale is x to one e4m3 rounding."""
    assert q.dtype == dtype and scale.dtype == torch.float32
    assert not q.float().isnan().any()
    atol = scale.float().max().item() * 2**-8
    torch.testing.assert_close(dequant(q, scale, group), x.float(), rtol=2**-4 + 2**-7, atol=atol)


def test_fn_to_fnuz_keeps_values_and_drops_negative_zero():
    x = torch.tensor([0.0, -0.0, -1e-9, 1.5, -448.0, 448.0, 3e-3, -0.3])
    q = x.to(FN)
    assert (q.view(torch.int8) == -128).sum() == 2  # -0.0 and -1e-9 round to fn's -0 (fnuz's NaN)
    qn, s = ref.fn_to_fnuz(q, torch.tensor([0.5]))
    assert qn.dtype == FNUZ and s.item() == 1.0
    assert not qn.float().isnan().any()
    assert torch.equal(qn.float() * s, q.float() * 0.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [0, 256, 128, 64, 32])
def test_dynamic_quant(aiter_ops, dtype, group):
    ops, fp8 = aiter_ops
    x = torch.randn(3, 5, 256).to(dtype) * 4
    q, scale = ops.fp8_quant_dynamic(x, group)
    want = {0: "per_tensor_quant_hip", 256: "per_token_quant_hip"}.get(group, "per_group_quant_hip")
    assert fake_aiter.CALLS == [want]
    assert q.shape == x.shape and scale.shape == tuple(ref.dynamic_scale_shape(x.shape, group))
    assert_quantised(q, scale, x, fp8, group if group else None)
    if fp8 == FN:  # AITER's fn quant is atomc's: the same bits and scales
        rq, rs = torch.ops.atomc.fp8_quant_dynamic(x, group)
        assert torch.equal(q.view(torch.int8), rq.view(torch.int8)) and torch.equal(scale, rs)
    else:  # the MI300 scale is amax / 240 (of the tensor, or of each group)
        k = group or x.numel()
        amax = x.float().reshape(-1, k).abs().amax(-1)
        torch.testing.assert_close(scale.reshape(-1), amax / 240)


def test_quant_calls_no_kernel_takes(aiter_ops):
    """fp32 activations and a group AITER has no kernel for: quantised in torch, still in AITER's dtype."""
    ops, fp8 = aiter_ops
    x = torch.randn(4, 96)
    for args in ((x, 96), (x.half(), 48), (x, 0)):
        q, s = ops.fp8_quant_dynamic(*args)
        assert_quantised(q, s, args[0], fp8, args[1] or None)
    assert_quantised(ops.fp8_quant_static(x, torch.tensor([0.05])), torch.tensor([0.05]), x, fp8)
    assert fake_aiter.CALLS == []


def test_static_quant(aiter_ops):
    ops, fp8 = aiter_ops
    x = torch.randn(2, 7, 64).to(torch.bfloat16)
    scale = torch.tensor([x.float().abs().max().item() / 200])
    q = ops.fp8_quant_static(x, scale)
    assert fake_aiter.CALLS == ["static_per_tensor_quant"] and q.shape == x.shape
    assert_quantised(q, scale, x, fp8)


def weights(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.1
    w[0, :5] = -1e-9  # bytes that are fn's -0: NaN if read as fnuz without fn_to_fnuz
    return w


@pytest.mark.parametrize("per", ["tensor", "token", "tensor-bias"])
@pytest.mark.parametrize("weight_dtype", ["fn", "device"])
def test_gemm(aiter_ops, per, weight_dtype):
    ops, fp8 = aiter_ops
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    wf = weights(48, 64)
    if per.startswith("tensor"):
        xq, xs = torch.ops.atomc.fp8_quant_dynamic(x, 0)
        ws = (wf.abs().amax() / 448).reshape(1)
        w = ref.to_fp8(wf, ws)
    else:
        xq, xs = torch.ops.atomc.fp8_quant_dynamic(x, 64)
        ws = wf.abs().amax(1) / 448
        w = ref.to_fp8(wf, ws[:, None])
    bias = torch.randn(48, dtype=torch.bfloat16) if per.endswith("bias") else None
    want = ref.fp8_gemm_reference(xq, xs, w, ws, bias, torch.bfloat16)
    if weight_dtype == "device" and fp8 == FNUZ:
        w, ws = ref.fn_to_fnuz(w, ws)  # as models/quant/fp8.py loads them on MI300
    got = ops.fp8_gemm(xq, xs, w, ws, bias, torch.bfloat16)
    assert fake_aiter.CALLS == ["gemm_a8w8"] and got.shape == (2, 3, 48) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_gemm_on_aiter_quantised_activations(aiter_ops):
    """AITER's quant into AITER's GEMM: on MI300 both in fnuz, no conversion between them."""
    ops, fp8 = aiter_ops
    x = torch.randn(5, 64, dtype=torch.float16)
    wf = weights(32, 64)
    ws = wf.abs().amax(1) / 448
    w = ref.to_fp8(wf, ws[:, None])
    if fp8 == FNUZ:
        w, ws = ref.fn_to_fnuz(w, ws)
    xq, xs = ops.fp8_quant_dynamic(x, 64)
    got = ops.fp8_gemm(xq, xs, w, ws, None, torch.float16)
    torch.testing.assert_close(got.float(), x.float() @ (w.float() * ws[:, None]).T, rtol=0.1, atol=0.1)
    assert fake_aiter.CALLS == ["per_token_quant_hip", "gemm_a8w8"]


def test_block_gemm(aiter_ops):
    ops, fp8 = aiter_ops
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    wf = weights(200, 256)  # 200 rows: the last block is partial
    ws = torch.rand(2, 2) * 1e-3 + 1e-4
    w = ref.to_fp8(wf / ref.expand_block_scale(ws, 128, 128, 200, 256), torch.ones(1))
    xq, xs = torch.ops.atomc.fp8_quant_dynamic(x, 128)
    bias = torch.randn(200, dtype=torch.bfloat16)
    want = ref.fp8_block_gemm_reference(xq, xs, w, ws, 128, 128, bias, torch.bfloat16)
    if fp8 == FNUZ:
        w, ws = ref.fn_to_fnuz(w, ws)
    got = ops.fp8_block_gemm(xq, xs, w, ws, 128, 128, bias, torch.bfloat16)
    assert fake_aiter.CALLS == ["gemm_a8w8_blockscale"]
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_gemms_decline_to_the_next_backend(aiter_ops):
    """fp32 outputs and 64 x 64 blocks: AITER's GEMMs do not take them; ROCm's next backend does."""
    ops, fp8 = aiter_ops
    x = torch.randn(3, 128)
    wf = weights(64, 128)
    xq, xs = torch.ops.atomc.fp8_quant_dynamic(x, 128)
    ws = wf.abs().amax(1) / 448
    w = ref.to_fp8(wf, ws[:, None])
    torch.testing.assert_close(
        ops.fp8_gemm(xq, xs, w, ws, None, torch.float32), ref.fp8_gemm_reference(xq, xs, w, ws, None, torch.float32)
    )
    xq, xs = torch.ops.atomc.fp8_quant_dynamic(x.bfloat16(), 64)
    bs = torch.rand(1, 2) * 1e-3
    got = ops.fp8_block_gemm(xq, xs, w, bs, 64, 64, None, torch.bfloat16)
    assert torch.equal(got, ref.fp8_block_gemm_reference(xq, xs, w, bs, 64, 64, None, torch.bfloat16))
    assert fake_aiter.CALLS == []


NORM_CASES = [("per-token", 256), ("group-128", 128)]


@pytest.mark.parametrize("name,group", NORM_CASES)
def test_rms_norm_quants(aiter_ops, name, group):
    ops, fp8 = aiter_ops
    g = torch.Generator().manual_seed(1)
    x, r = (torch.randn(6, 256, generator=g).to(torch.bfloat16) for _ in range(2))
    w = (1 + 0.2 * torch.randn(256, generator=g)).to(torch.bfloat16)
    normed = rms_norm_reference(x, w, 1e-6).float()
    q, s = ops.rms_norm_fp8_quant_dynamic(x, w, 1e-6, group)
    assert s.shape == (6, 256 // group)
    assert_quantised(q, s, normed, fp8, group)
    q, s, summed = ops.fused_add_rms_norm_fp8_quant_dynamic(x, r, w, 1e-6, group)
    assert torch.equal(summed, x + r)
    assert_quantised(q, s, rms_norm_reference(x + r, w, 1e-6), fp8, group)
    assert fake_aiter.CALLS == ["rmsnorm2d_fwd_with_dynamicquant", "rmsnorm2d_fwd_with_add_dynamicquant"]


def test_static_rms_norm_quants_run_norm_then_quant(aiter_ops):
    ops, fp8 = aiter_ops
    x, r = torch.randn(5, 64).half(), torch.randn(5, 64).half()
    w = torch.rand(64).half() + 0.5
    scale = torch.tensor([0.02])
    assert_quantised(ops.rms_norm_fp8_quant_static(x, w, 1e-6, scale), scale, rms_norm_reference(x, w, 1e-6), fp8)
    q, summed = ops.fused_add_rms_norm_fp8_quant_static(x, r, w, 1e-6, scale)
    assert_quantised(q, scale, rms_norm_reference(x + r, w, 1e-6), fp8)
    assert torch.equal(summed, x + r)
    assert fake_aiter.CALLS == ["rmsnorm2d_fwd", "static_per_tensor_quant", "rmsnorm2d_fwd_with_add",
                                "static_per_tensor_quant"]  # fmt: skip


@pytest.mark.parametrize("d,group,fused", [(256, 256, True), (256, 128, True), (192, 192, False)])
def test_silu_and_mul_quants(aiter_ops, d, group, fused):
    """192 per token is no power of two: AITER's SiLU·mul, then the plain quant."""
    ops, fp8 = aiter_ops
    x = torch.randn(2, 3, 2 * d).to(torch.bfloat16)
    y = fp8_fused.silu_and_mul_reference(x).float()
    q, s = ops.silu_and_mul_fp8_quant_dynamic(x, group)
    assert q.shape == (2, 3, d) and s.shape == (2, 3, d // group)
    assert_quantised(q, s, y, fp8, group)
    assert fake_aiter.CALLS == (["silu_and_mul_quant"] if fused else ["per_token_quant_hip"])
    fake_aiter.CALLS.clear()
    scale = torch.tensor([y.abs().max().item() / 200])
    assert_quantised(ops.silu_and_mul_fp8_quant_static(x, scale), scale, y, fp8)
    assert fake_aiter.CALLS == ["silu_and_mul", "static_per_tensor_quant"]


def test_fakes_promise_aiters_dtype(aiter_ops):
    """A traced graph sees the quants' outputs in the dtype they write (fnuz on MI300)."""
    ops, fp8 = aiter_ops
    with FakeTensorMode():
        x = torch.empty(4, 256, dtype=torch.bfloat16)
        q, s = ops.fp8_quant_dynamic(x, 128)
        q2, s2, summed = ops.fused_add_rms_norm_fp8_quant_dynamic(x, x, torch.empty(256), 1e-6, 256)
        q3 = ops.silu_and_mul_fp8_quant_static(x, torch.empty(1))
        out = ops.fp8_gemm(q, s, torch.empty(8, 256, dtype=fp8), torch.empty(8), None, torch.bfloat16)
    assert q.dtype == q2.dtype == q3.dtype == fp8 and s.shape == (4, 2) and s2.shape == (4, 1)
    assert q3.shape == (4, 128) and summed.dtype == torch.bfloat16 and out.shape == (4, 8)


def test_registry_lowers_the_fp8_ops_to_aiter_on_rocm_only(monkeypatch):
    monkeypatch.setattr(registry, "backend_available", lambda backend: True)
    for op in ("fp8_quant_static", "fp8_quant_dynamic", "fp8_gemm", "fp8_block_gemm", *fp8_fused.FUSED_QUANT_OPS):
        assert registry.choose_backend(op, "rocm") == "aiter"
        assert registry.choose_backend(op, "cuda") == "triton"
        assert registry.choose_backend(op, "cpu") == "torch"
    assert "atomc.kernels.aiter.fp8" in registry.chosen_modules("rocm")  # in the compile cache key
    assert "atomc.kernels.aiter.fp8" not in registry.chosen_modules("cuda")
