"""The stand-in `aiter`'s FP8 functions (tests/kernels/fake_aiter.py puts them on the module): the
quants of aiter/ops/quant.py, the GEMMs of aiter/ops/gemm_op_a8w8.py, the RMSNorm quants of
aiter/ops/rmsnorm.py and silu_and_mul_quant of aiter/ops/activation.py, keyword-only with the real
argument names and defaults (a default the wrapper must override, such as quant_dtype=i8, stays the
real one, so forgetting it fails). Each asserts what the real kernel requires (its dtypes, shapes,
layouts, the limits its source checks) and computes the reference in plain torch, in the e4m3 dtype
the module's `dtypes.fp8` names: float8_e4m3fnuz (max 240) as on MI300, or float8_e4m3fn (448) as
on MI350. Scales are amax / max of that dtype, as AITER computes them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

CALLS: list[str] = []  # fake_aiter.CALLS is this list
FP8 = [torch.float8_e4m3fn]  # the e4m3 dtype `dtypes.fp8` names, set by fake_aiter.module()
HALF = (torch.float16, torch.bfloat16)  # AITER_DISPATCH_FLOATING16_TYPES


def fp8() -> torch.dtype:
    return FP8[0]


def _quant(y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    top = torch.finfo(fp8()).max
    return (y.float() / scale).clamp(-top, top).to(fp8())


def _dynamic(y: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """y [M, K] fp32 -> (q, scale [M, K / group]) with amax / max per group (group K: per row)."""
    m, k = y.shape
    g = y.reshape(m, k // group, group)
    # an all-zero group: AITER's own result is not checked here; 1e-12 keeps the stand-in finite
    scale = (g.abs().amax(-1, keepdim=True) / torch.finfo(fp8()).max).clamp(min=1e-12)
    return _quant(g, scale).reshape(m, k), scale.squeeze(-1)


def _check_quant_dtype(quant_dtype):
    assert quant_dtype == fp8(), f"quant_dtype {quant_dtype}: this GPU's FP8 is dtypes.fp8 = {fp8()}"


def static_per_tensor_quant(*, out, input, scale):
    CALLS.append("static_per_tensor_quant")
    assert input.dtype in HALF and out.dtype == fp8() and out.shape == input.shape
    assert input.is_contiguous() and out.is_contiguous()
    assert scale.dtype == torch.float32 and scale.numel() == 1
    out.copy_(_quant(input, scale.reshape(())))  # x * (1 / scale)


def per_tensor_quant_hip(*, x, scale=None, quant_dtype=torch.int8, num_rows=None, num_rows_factor=1):
    CALLS.append("per_tensor_quant_hip")
    _check_quant_dtype(quant_dtype)
    assert x.dtype in HALF and num_rows is None
    if scale is not None:
        return _quant(x, scale.reshape(())), scale.view(1)
    s = (x.float().abs().amax() / torch.finfo(fp8()).max).clamp(min=1e-12).reshape(1)
    return _quant(x, s), s


def per_token_quant_hip(*, x, scale=None, quant_dtype=torch.int8, num_rows=None, num_rows_factor=1):
    CALLS.append("per_token_quant_hip")
    if scale is not None:
        raise ValueError("unsupported: static per token quant")
    _check_quant_dtype(quant_dtype)
    assert x.dtype in HALF and x.is_contiguous() and num_rows is None
    q, s = _dynamic(x.float().reshape(-1, x.shape[-1]), x.shape[-1])
    return q.view(x.shape), s.view(*x.shape[:-1], 1)


def per_group_quant_hip(
    *, x, scale=None, quant_dtype=torch.int8, group_size=128, transpose_scale=False, num_rows=None,
    num_rows_factor=1, scale_type=torch.float32,
):  # fmt: skip
    CALLS.append("per_group_quant_hip")
    if scale is not None:
        raise ValueError("unsupported: static per token quant")
    assert group_size in [32, 64, 128], f"unsupported group size {group_size=}, only support [32, 64, 128]"
    _check_quant_dtype(quant_dtype)
    assert x.dtype in HALF and x.is_contiguous() and num_rows is None and scale_type == torch.float32
    assert not transpose_scale, "the stand-in models row-major scales only"
    q, s = _dynamic(x.float().reshape(-1, x.shape[-1]), group_size)
    return q.view(x.shape), s.view(*x.shape[:-1], x.shape[-1] // group_size)


def gemm_a8w8(*, XQ, WQ, x_scale, w_scale, bias=None, dtype=torch.bfloat16, splitK=None):
    """Per-row scales on both operands: x_scale [M, 1], w_scale [N, 1], fp32."""
    CALLS.append("gemm_a8w8")
    assert XQ.dim() == WQ.dim() == 2 and XQ.shape[1] == WQ.shape[1], "XQ [M, K], WQ [N, K]"
    assert XQ.dtype == WQ.dtype == fp8(), f"operands in dtypes.fp8 ({fp8()}): {XQ.dtype}, {WQ.dtype}"
    m, n = XQ.shape[0], WQ.shape[0]
    assert x_scale.shape == (m, 1) and w_scale.shape == (n, 1), f"{x_scale.shape} {w_scale.shape}"
    assert x_scale.dtype == w_scale.dtype == torch.float32 and x_scale.is_contiguous() and w_scale.is_contiguous()
    assert dtype in HALF and bias is None, "fp16/bf16 out; the CK FP8 kernel is run without a bias"
    return ((XQ.float() * x_scale) @ (WQ.float() * w_scale).T).to(dtype)


def gemm_a8w8_blockscale(*, XQ, WQ, x_scale, w_scale, dtype=torch.bfloat16, isBpreshuffled=False):
    """128 x 128 weight blocks; x_scale [M, ceil(K/128)] row-major, w_scale [ceil(N/128), ceil(K/128)]."""
    CALLS.append("gemm_a8w8_blockscale")
    assert dtype in HALF, f"Output {dtype=} is currently not supported in gemm_a8w8"
    assert not isBpreshuffled and XQ.dim() == WQ.dim() == 2 and XQ.shape[1] == WQ.shape[1]
    assert XQ.dtype == WQ.dtype == fp8(), f"operands in dtypes.fp8 ({fp8()}): {XQ.dtype}, {WQ.dtype}"
    (m, k), n = XQ.shape, WQ.shape[0]
    sk, sn = -(-k // 128), -(-n // 128)
    assert x_scale.shape == (m, sk) and x_scale.is_contiguous() and w_scale.shape == (sn, sk)
    assert x_scale.dtype == w_scale.dtype == torch.float32
    x = XQ.float() * x_scale.repeat_interleave(128, 1)[:, :k]
    w = WQ.float() * w_scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return (x @ w.T).to(dtype)


def _norm_rows(x, weight, eps):
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def _check_norm_quant(out, input, yscale, weight, use_model_sensitive_rmsnorm, group_size, shuffle_scale):
    assert input.dim() == 2 and input.dtype in HALF and input.is_contiguous() and weight.shape == input.shape[-1:]
    assert out.shape == input.shape and out.dtype == fp8() and yscale.dtype == torch.float32
    assert use_model_sensitive_rmsnorm == 0 and not shuffle_scale
    m, k = input.shape
    if group_size:
        assert k <= 8192, "grouped/shuffle rmsnorm dynamicquant supports hidden<=8192"
        assert k % group_size == 0 and yscale.shape == (m, k // group_size)
    else:
        assert yscale.numel() == m, "group_size 0: one scale a row"
    return group_size or k


def rmsnorm2d_fwd_with_dynamicquant(
    *, out, input, yscale, weight, epsilon, use_model_sensitive_rmsnorm=0, group_size=0, shuffle_scale=False
):
    CALLS.append("rmsnorm2d_fwd_with_dynamicquant")
    g = _check_norm_quant(out, input, yscale, weight, use_model_sensitive_rmsnorm, group_size, shuffle_scale)
    q, s = _dynamic(_norm_rows(input, weight, epsilon), g)
    out.copy_(q)
    yscale.view(s.shape).copy_(s)


def rmsnorm2d_fwd_with_add_dynamicquant(
    *, out, input, residual_in, residual_out, yscale, weight, epsilon, use_model_sensitive_rmsnorm=0, group_size=0,
    shuffle_scale=False,
):  # fmt: skip
    CALLS.append("rmsnorm2d_fwd_with_add_dynamicquant")
    g = _check_norm_quant(out, input, yscale, weight, use_model_sensitive_rmsnorm, group_size, shuffle_scale)
    assert residual_in.shape == residual_out.shape == input.shape and residual_out.dtype == input.dtype
    residual_out.copy_(input + residual_in)
    q, s = _dynamic(_norm_rows(residual_out, weight, epsilon), g)
    out.copy_(q)
    yscale.view(s.shape).copy_(s)


def silu_and_mul_quant(*, out, input, scale, group_size, limit=0.0, shuffle_scale=False):
    CALLS.append("silu_and_mul_quant")
    d = input.shape[-1] // 2
    assert group_size > 0, "silu_and_mul_quant: group_size must be > 0"
    assert d % group_size == 0, "silu_and_mul_quant: d must be divisible by group_size"
    assert group_size & (group_size - 1) == 0, "silu_and_mul_quant: group_size must be power of 2"
    assert d <= 8192, "silu_and_mul_quant: d > 8192 not supported"
    assert input.dtype in HALF and out.dtype == fp8(), "only fp8 and fp4 output types are supported"
    assert limit == 0.0 and not shuffle_scale and input.dim() == 2 and input.is_contiguous()
    m = input.shape[0]
    assert out.shape == (m, d) and scale.shape == (m, d // group_size) and scale.dtype == torch.float32
    gate, up = input.float().chunk(2, dim=-1)
    q, s = _dynamic(F.silu(gate) * up, group_size)
    out.copy_(q)
    scale.copy_(s)


FUNCTIONS = (static_per_tensor_quant, per_tensor_quant_hip, per_token_quant_hip, per_group_quant_hip, gemm_a8w8,
             gemm_a8w8_blockscale, rmsnorm2d_fwd_with_dynamicquant, rmsnorm2d_fwd_with_add_dynamicquant,
             silu_and_mul_quant)  # fmt: skip
