"""The FP8 atomc ops: schemas and fake impls (opcheck), the references against a direct dequantise-
then-multiply, and on a GPU the torch._scaled_mm backend against the reference."""

from __future__ import annotations

import pytest
import torch

import atomc.ops  # noqa: F401
from atomc.kernels import registry
from atomc.ops.fp8 import fp8_gemm_reference

FP8 = torch.float8_e4m3fn
ops = torch.ops.atomc


def _fp8(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 100).clamp(-448, 448).to(FP8)


def test_dynamic_quant_scales_and_rounding():
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    x[2] = 0  # an all-zero row quantises to zeros, not NaN
    q, s = ops.fp8_quant_dynamic(x, 256)  # per token
    assert q.dtype == FP8 and s.shape == (5, 1)
    torch.testing.assert_close(s[0, 0], x[0].abs().max() / 448)
    assert torch.equal(q[2].float(), torch.zeros(256))
    assert q.float().abs().amax(dim=1)[[0, 1, 3, 4]].eq(448).all()  # each row's amax maps to the fp8 max
    rel = ((q.float() * s - x).abs() / x.abs().clamp(min=1e-3))[x.abs() > 0.1]
    assert rel.max() <= 2**-4 + 1e-6  # e4m3: 3 mantissa bits, round to nearest
    q, s = ops.fp8_quant_dynamic(x, 128)  # per token group
    assert s.shape == (5, 2)
    torch.testing.assert_close(s[1, 1], x[1, 128:].abs().max() / 448)
    q, s = ops.fp8_quant_dynamic(x, 0)  # per tensor
    assert s.shape == (1,)
    with pytest.raises(ValueError, match="group size 100 does not divide the row length 256"):
        ops.fp8_quant_dynamic(x, 100)


def test_gemm_is_the_dequantised_product():
    xq, w = _fp8((6, 64)), _fp8((48, 64), 1)
    xs, ws = torch.rand(6, 1) / 100, torch.rand(48) / 100
    bias = torch.randn(48)
    want = (xq.float() * xs) @ (w.float() * ws[:, None]).t() + bias
    torch.testing.assert_close(ops.fp8_gemm(xq, xs, w, ws, bias, torch.float32), want)
    scalar = ops.fp8_gemm(xq, xs[:1, 0], w, ws[:1], None, torch.float32)
    torch.testing.assert_close(scalar, xq.float() @ w.float().t() * xs[0, 0] * ws[0])


def test_block_gemm_is_the_dequantised_product_with_ragged_blocks():
    n, k, bn, bk = 200, 256, 128, 128  # 200 rows: the last block row is partial (as DeepSeek's shapes)
    xq, w = _fp8((3, k)), _fp8((n, k), 1)
    xs, ws = torch.rand(3, k // bk) / 100, torch.rand(2, 2) / 100
    w_deq = w.float().clone()
    for i in range(2):
        for j in range(2):
            w_deq[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] *= ws[i, j]
    x_deq = xq.float() * xs.repeat_interleave(bk, 1)
    got = ops.fp8_block_gemm(xq, xs, w, ws, bn, bk, None, torch.float32)
    torch.testing.assert_close(got, x_deq @ w_deq.t())


# test_schema's checker cannot compare fp8 tensors on the CPU; the fake and dynamic-shape checks run
CHECKS = ("test_faketensor", "test_aot_dispatch_dynamic")


def test_schemas_and_fakes():
    x = torch.randn(4, 128)
    xq, w = _fp8((4, 128)), _fp8((32, 128), 1)
    torch.library.opcheck(ops.fp8_quant_static, (x, torch.tensor([0.01])), test_utils=CHECKS)
    torch.library.opcheck(ops.fp8_quant_dynamic, (x, 128), test_utils=CHECKS)
    torch.library.opcheck(ops.fp8_quant_dynamic, (x, 0), test_utils=CHECKS)
    torch.library.opcheck(
        ops.fp8_gemm, (xq, torch.rand(4, 1), w, torch.rand(32), None, torch.float32), test_utils=CHECKS
    )
    torch.library.opcheck(
        ops.fp8_block_gemm,
        (xq, torch.rand(4, 1), w, torch.rand(1, 1), 128, 128, None, torch.float32),
        test_utils=CHECKS,
    )


def test_registry_lowers_every_fp8_op():
    for op in ("fp8_quant_static", "fp8_quant_dynamic", "fp8_gemm", "fp8_block_gemm"):
        assert op in registry.OPS and registry.is_known(f"atomc::{op}")
        assert registry.choose_backend(op, "cpu") == "torch"
    assert ("fp8_gemm", "triton") in registry.entries()  # torch._scaled_mm on CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 7, 64])
@pytest.mark.parametrize("rowwise", [False, True])
def test_scaled_mm_backend_matches_the_reference(m, rowwise):
    from atomc.kernels.triton import fp8 as backend

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need sm_89+")
    xq, w = _fp8((m, 256)).cuda(), _fp8((384, 256), 1).cuda()
    xs = (torch.rand(m, 1) / 100).cuda() if rowwise else torch.tensor([0.01], device="cuda")
    ws = (torch.rand(384) / 100).cuda() if rowwise else torch.tensor([0.02], device="cuda")
    bias = torch.randn(384, device="cuda", dtype=torch.bfloat16)
    got = backend.scaled_mm(xq, xs, w, ws, bias, torch.bfloat16)
    assert got is not None  # _scaled_mm ran, not the fallback
    want = fp8_gemm_reference(xq, xs, w, ws, bias, torch.float32)
    # bf16 output: 8 mantissa bits on values up to |want|max
    torch.testing.assert_close(got.float(), want, atol=0.01 * want.abs().max().item(), rtol=0.01)
    # the lowered op (the FP8 GEMV at one row: another computation than _scaled_mm) and the eager
    # model's op on CUDA (the same backend) each against the reference, with the same tolerance
    lowered = registry.lookup("fp8_gemm", "triton")
    for out in (lowered(xq, xs, w, ws, bias, torch.bfloat16), ops.fp8_gemm(xq, xs, w, ws, bias, torch.bfloat16)):
        torch.testing.assert_close(out.float(), want, atol=0.01 * want.abs().max().item(), rtol=0.01)
