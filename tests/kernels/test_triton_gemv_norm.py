"""The one-row GEMV whose last program adds the residual and normalises (gemv_norm.py), on CPU through
the Triton interpreter, against the two kernels it replaces and against the ops' references.

Tolerances: the fused kernel runs the unfused kernels' arithmetic (the same row loop, the same norm
and quant formulas), so against them only fp32 round-off of a different reduction tree is allowed
(rel 1e-5) and a few e4m3 rounding-boundary flips; against the torch references, which sum in
another order, fp16 rounding of the GEMV's output (rel 2e-3)."""

import pytest
import torch
from triton_interpreter import use_interpreter

use_interpreter()  # before the first triton import

triton = pytest.importorskip("triton")

import atomc.ops  # noqa: E402, F401
from atomc.kernels import registry  # noqa: E402
from atomc.kernels.triton import fp8_quant, gemv_norm, linear_norm  # noqa: E402
from atomc.kernels.triton.fp8_gemv import fp8_gemv  # noqa: E402
from atomc.kernels.triton.gemv import linear as gemv_linear  # noqa: E402
from atomc.kernels.triton.rmsnorm import fused_add_rms_norm  # noqa: E402
from atomc.ops import linear_norm as ref  # noqa: E402

FP8 = torch.float8_e4m3fn


def close(got, want, rel=1e-5):
    err = (got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30)
    assert err < rel, f"relative error {err:.3g}"


def fp8_close(q_got, q_want, max_flips=4):
    assert q_got.dtype == FP8 and q_got.shape == q_want.shape
    a, b = q_got.float(), q_want.float()
    diff = (a - b).abs()
    assert int((diff > 0).sum()) <= max_flips
    assert (diff <= 0.125 * torch.maximum(a.abs(), b.abs()) + 2**-9).all()


def rand(*shape, seed=0, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def bf16_case(n, k, dtype, bias, seed=0):
    x = rand(1, k, seed=seed, dtype=dtype)
    w = rand(n, k, seed=seed + 1, scale=k**-0.5, dtype=dtype)
    b = rand(n, seed=seed + 2, dtype=dtype) if bias else None
    res = rand(1, n, seed=seed + 3, dtype=dtype)
    nw = (1 + 0.3 * rand(n, seed=seed + 4)).to(dtype)
    return x, w, b, res, nw


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,bias", [(96, 200, True), (64, 2048, False), (1000, 64, False)])
def test_fused_row_matches_the_two_kernels(n, k, bias, dtype):
    x, w, b, res, nw = bf16_case(n, k, dtype, bias)
    for call in range(2):  # the last program resets the counter for the next launch
        normed, summed = gemv_norm.linear_add_rms_norm(x, w, b, res, nw, 1e-6)
        want_normed, want_summed = fused_add_rms_norm(gemv_linear(x, w, b).contiguous(), res, nw, 1e-6)
        assert normed.shape == summed.shape == res.shape and normed.dtype == dtype
        close(summed, want_summed)
        close(normed, want_normed)
        b32 = None if b is None else b.float()
        want = ref.linear_add_rms_norm_reference(x.float(), w.float(), b32, res.float(), nw.float(), 1e-6)
        ref_normed, ref_summed = want
        close(summed, ref_summed, rel=2e-3)
        close(normed, ref_normed, rel=2e-3)
        x = rand(1, k, seed=10 + call, dtype=dtype)


def test_fused_row_declines_what_it_does_not_take():
    x, w, b, res, nw = bf16_case(64, 128, torch.float32, False)
    assert gemv_norm.linear_add_rms_norm(x.expand(2, 128), w, b, res.expand(2, 64), nw, 1e-6) is None  # two rows
    assert gemv_norm.linear_add_rms_norm(x, w, b, res, nw.half(), 1e-6) is None  # a norm weight of another dtype
    assert gemv_norm.linear_add_rms_norm(x.half(), w, b, res, nw, 1e-6) is None


def fp8_case(n, k, per_row, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(FP8)
    xq = (torch.randn(1, k, generator=g) * 64).clamp(-448, 448).to(FP8)
    xs = torch.tensor([[0.013]])
    ws = torch.rand(n, generator=g) / 200 if per_row else torch.tensor([0.004])
    res = torch.randn(1, n, generator=g) * 4
    nw = 1 + 0.3 * torch.randn(n, generator=g)
    return xq, xs, w, ws, res, nw


@pytest.mark.parametrize("kernel", ["reduce", "reduce_f16"])
@pytest.mark.parametrize("n,k,per_row,group", [(256, 512, True, 256), (256, 384, False, 128), (200, 256, True, 200)])
def test_fp8_fused_row_matches_the_two_kernels(n, k, per_row, group, kernel):
    xq, xs, w, ws, res, nw = fp8_case(n, k, per_row)
    knobs = dict(kernel=kernel, block_n=4, block_k=128)
    got = gemv_norm.fp8_gemv_add_rms_norm_quant(xq, xs, w, ws, None, torch.float32, res, nw, 1e-6, group, knobs)
    assert got is not None
    q, s, summed = got
    y = fp8_gemv(xq, xs, w, ws, None, torch.float32, **knobs)
    want_q, want_s, want_summed = fp8_quant.rms_norm_quant(y, res, nw, 1e-6, None, group)
    assert s.shape == want_s.shape == (1, n // group)
    close(summed, want_summed)
    close(s, want_s)
    fp8_close(q, want_q)


def test_fp8_fused_row_declines_the_tensor_core_tile_and_other_dtypes():
    xq, xs, w, ws, res, nw = fp8_case(256, 512, True)
    args = (xq, xs, w, ws, None)
    assert gemv_norm.fp8_gemv_add_rms_norm_quant(*args, torch.float32, res, nw, 1e-6, 256, {"kernel": "dot"}) is None
    assert gemv_norm.fp8_gemv_add_rms_norm_quant(*args, torch.float16, res, nw, 1e-6, 256) is None
    assert gemv_norm.fp8_gemv_add_rms_norm_quant(*args, torch.float32, res, nw, 1e-6, 96) is None  # not a group


@pytest.mark.parametrize("fused", [False, True])
def test_the_bindings_give_the_references_numbers_with_the_switch_on_and_off(monkeypatch, fused):
    monkeypatch.setattr(linear_norm, "ONE_ROW_ADD_NORM", fused)
    triton_ops = registry._triton_ops()
    x, w, b, res, nw = bf16_case(128, 256, torch.float32, True, seed=5)
    got = triton_ops.linear_add_rms_norm.default(x, w, b, res, nw, 1e-5)
    want = torch.ops.atomc.linear_add_rms_norm(x, w, b, res, nw, 1e-5)
    for g, wt in zip(got, want, strict=True):
        close(g, wt)
    g = torch.Generator().manual_seed(6)
    wq = (torch.randn(128, 512, generator=g) * 64).clamp(-448, 448).to(FP8)
    ws = torch.rand(128, generator=g) / 200
    for silu, k in ((False, 512), (True, 1024)):
        x = torch.randn(1, k, generator=g)
        args = (x, 512, wq, ws, None, torch.float32, silu, res, nw, 1e-5, 128)
        q, s, summed = triton_ops.fp8_linear_add_rms_norm_quant.default(*args)
        want_q, want_s, want_summed = torch.ops.atomc.fp8_linear_add_rms_norm_quant(*args)
        close(summed, want_summed, rel=1e-4)  # the quant of x may flip a value: 1e-4 covers one flip's share
        close(s, want_s, rel=1e-4)
        fp8_close(q, want_q, max_flips=8)
