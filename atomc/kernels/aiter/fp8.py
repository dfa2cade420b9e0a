"""`torch.ops.atomc_aiter.*` for the FP8 linears: activation quants, the two GEMMs and the fused
RMSNorm / SiLU·mul quants (atomc/ops/fp8.py, fp8_fused.py) on AITER (ROCm). UNTESTED ON AMD
HARDWARE: checked only against the stand-in `aiter` of tests/kernels/fake_aiter.py, on CPU.

The e4m3 dtype is AITER's own, `aiter.dtypes.fp8`: float8_e4m3fnuz on MI300 (gfx942, max 240),
float8_e4m3fn on MI350 (gfx950, max 448). A pair (q, scale) means q.float() * scale in either, so:
- the quants here write AITER's dtype with AITER's scales (amax / 240 on MI300), and their fakes say
  so (the only difference from the atomc op's: the dtype);
- the GEMMs take AITER's dtype; an e4m3fn operand (an activation another backend quantised) is moved
  across exactly by `fn_to_fnuz` (same bits, -0 -> 0, scale doubled), as vLLM and ATOM normalise
  e4m3fn checkpoints for MI300. Weights are moved once at load (models/quant/fp8.py), so that
  per-call copy is only ever an activation's.

    fp8_quant_static                 static_per_tensor_quant (x * 1/scale)
    fp8_quant_dynamic                group 0: per_tensor_quant_hip; group K: per_token_quant_hip;
                                     group 32/64/128: per_group_quant_hip
    fp8_gemm                         gemm_a8w8 (x_scale [M, 1], w_scale [N, 1]; bias added after:
                                     AITER's CK FP8 kernel is run without one)
    fp8_block_gemm                   gemm_a8w8_blockscale (128 x 128 blocks, x_scale [M, K/128])
    fp8_gemm_shuffled                gemm_a8w8_bpreshuffle (the weight in shuffle_weight's (16, 16)
                                     order; scales as gemm_a8w8's; it takes no bias: added after)
    fp8_block_gemm_shuffled          gemm_a8w8_blockscale_bpreshuffle (the weight shuffled so;
                                     x_scale column-major: [K/128, M] in memory, viewed [M, K/128])
    rms_norm_fp8_quant_dynamic       rmsnorm2d_fwd_with_dynamicquant (group_size 0 = per token)
    fused_add_rms_norm_..._dynamic   rmsnorm2d_fwd_with_add_dynamicquant
    silu_and_mul_fp8_quant_dynamic   silu_and_mul_quant (a power-of-two group dividing the row)
    the static fused quants          no AITER kernel takes a device scale (scaled_silu_and_mul reads
                                     it on the host; the RMSNorm quants' scale is an output): AITER's
                                     RMSNorm / SiLU·mul, then static_per_tensor_quant

What no AITER kernel takes (fp32 activations or outputs, other groups or blocks, rows past 8192 for
the grouped and fused kernels) runs here in torch for the quants (writing AITER's dtype, so a graph's
dtypes do not depend on the call), and on ROCm's next backend (Triton, else the reference) for the
GEMMs, which read any e4m3 dtype by value; for the `_shuffled` GEMMs that is the reference, which
unshuffles the weight (atomc/ops/fp8_shuffled.py: the loader shuffles a linear's weight only where
these take it, so that is a call with no rows or an fp32 output, which the loader avoids too).

The block GEMM over shuffled weights is gemm_a8w8_blockscale_bpreshuffle (what ATOM runs by
default, ATOM_FP8_BLOCKSCALE_WEIGHT_PRESHUFFLE=1), not gemm_a8w8_blockscale(isBpreshuffled=True):
AITER's source runs the latter only on gfx950 for M >= 16, K >= 512 and bf16 outputs and asserts
otherwise (aiter/ops/gemm_op_a8w8.py, gemm_a8w8_blockscale). Its column-major x_scale is a transpose
of the row-major scales atomc's quants write (one small copy a call; AITER's quants could write it
so directly: per_group_quant_hip(transpose_scale=True), not wired).
"""

from __future__ import annotations

import torch

from atomc.kernels.aiter import ops as bf16_ops  # AITER's RMSNorm and SiLU·mul, as the bf16 ops call them
from atomc.kernels.aiter.fallback import NextBackend
from atomc.kernels.binding import bind_as_atomc, named_args
from atomc.ops.fp8 import FNUZ_DTYPE, FP8_DTYPE, MIN_SCALE, fn_to_fnuz
from atomc.ops.fp8_fused import FUSED_QUANT_OPS, silu_and_mul_reference
from atomc.ops.norm import rms_norm_reference

HALF_DTYPES = (torch.float16, torch.bfloat16)  # what AITER's quant, norm and GEMM kernels take
GROUPS = (32, 64, 128)  # per_group_quant_hip's group sizes (it asserts them)
MAX_FUSED_ROW = 8192  # grouped RMSNorm quant and silu_and_mul_quant: rows of at most 8192
BLOCK = (128, 128)  # gemm_a8w8_blockscale's block (its kernels are built for it)


def _aiter():
    import aiter

    return aiter


def fp8_dtype() -> torch.dtype:
    """AITER's e4m3 dtype on this GPU (fnuz on MI300, fn on MI350)."""
    return _aiter().dtypes.fp8


def as_aiter_fp8(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) in AITER's dtype, the same values."""
    want = fp8_dtype()
    if q.dtype == want:
        return q, scale
    if q.dtype == FP8_DTYPE and want == FNUZ_DTYPE:
        return fn_to_fnuz(q, scale.float())
    raise TypeError(f"AITER's FP8 dtype here is {want}; got an operand in {q.dtype}")


def _q_in_aiter_dtype(out, *args, **kwargs):
    """The fake of a quant binding: the atomc op's, its q (the first output) in AITER's dtype."""
    dtype = fp8_dtype()
    if isinstance(out, torch.Tensor):
        return torch.empty_like(out, dtype=dtype)
    return (torch.empty_like(out[0], dtype=dtype), *out[1:])


# ---- torch quants into AITER's dtype (what the bindings run where no kernel takes the call) ----


def quant_static_torch(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    dtype = fp8_dtype()
    top = torch.finfo(dtype).max
    return (x.float() / scale.float()).clamp(-top, top).to(dtype)


def quant_dynamic_torch(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = fp8_dtype()
    top = torch.finfo(dtype).max
    xf = x.float()
    if group_size == 0:
        scale = (xf.abs().amax() / top).clamp(min=MIN_SCALE).reshape(1)
        return (xf / scale).clamp(-top, top).to(dtype), scale
    k = x.shape[-1]
    if group_size < 0 or k % group_size:
        raise ValueError(f"fp8_quant_dynamic: group size {group_size} does not divide the row length {k}")
    groups = xf.unflatten(-1, (k // group_size, group_size))
    scale = (groups.abs().amax(dim=-1, keepdim=True) / top).clamp(min=MIN_SCALE)
    q = (groups / scale).clamp(-top, top).to(dtype).flatten(-2)
    return q, scale.squeeze(-1)


# ---- activation quants ----


def quant_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if x.dtype not in HALF_DTYPES or x.numel() == 0:
        return quant_static_torch(x, scale)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(rows.shape, dtype=fp8_dtype(), device=x.device)
    _aiter().static_per_tensor_quant(out=out, input=rows, scale=scale.float().reshape(1))
    return out.view(x.shape)


def quant_dynamic(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = x.shape[-1]
    if x.dtype not in HALF_DTYPES or x.numel() == 0:
        return quant_dynamic_torch(x, group_size)
    aiter, rows = _aiter(), x.reshape(-1, k).contiguous()
    if group_size == 0:
        q, scale = aiter.per_tensor_quant_hip(x=rows, scale=None, quant_dtype=fp8_dtype())
        return q.view(x.shape), scale.reshape(1)
    if group_size == k:
        q, scale = aiter.per_token_quant_hip(x=rows, scale=None, quant_dtype=fp8_dtype())
    elif group_size in GROUPS and k % group_size == 0:
        q, scale = aiter.per_group_quant_hip(
            x=rows, scale=None, quant_dtype=fp8_dtype(), group_size=group_size, transpose_scale=False
        )
    else:
        return quant_dynamic_torch(x, group_size)
    return q.view(x.shape), scale.view(*x.shape[:-1], k // group_size)


@bind_as_atomc("atomc_aiter", "fp8_quant_static", fake=_q_in_aiter_dtype)
def fp8_quant_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return quant_static(x, scale)


@bind_as_atomc("atomc_aiter", "fp8_quant_dynamic", fake=_q_in_aiter_dtype)
def fp8_quant_dynamic(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quant_dynamic(x, group_size)


# ---- GEMMs ----

# ROCm's next backend for what AITER declines (fallback.py)
# next_backend(op_name, *args): atomc::<op_name> on ROCm's first available backend after AITER
next_backend = NextBackend("atomc_aiter's FP8 ops")
set_next_backend = next_backend.set


def gemm_declines(xq: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> str | None:
    """Why AITER's FP8 GEMMs cannot run this call (None when they can)."""
    if out_dtype not in HALF_DTYPES:
        return f"output dtype {out_dtype}: AITER's FP8 GEMMs write fp16/bf16"
    if weight.dim() != 2 or weight.stride(-1) != 1:
        return "weight not a row-major [N, K] matrix"
    if xq.numel() == 0:
        return "no rows"
    return None


def _add_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return out if bias is None else out + bias.to(out.dtype)


def _row_scaled_gemm(op: str, args: tuple, kernel: str) -> torch.Tensor:
    """fp8_gemm (or its shuffled twin) on AITER's `kernel`, gemm_a8w8 or gemm_a8w8_bpreshuffle: the
    same keywords, one scale per row of each operand (a per-tensor [1] is spread to them)."""
    a = named_args(op, args)
    if gemm_declines(a.xq, a.weight, a.out_dtype) is not None:
        return next_backend(op, *args)
    n, k = a.weight.shape
    xq, x_scale = as_aiter_fp8(a.xq, a.x_scale)
    weight, w_scale = as_aiter_fp8(a.weight, a.weight_scale)  # bytewise, so a shuffled layout stays
    rows = xq.reshape(-1, k).contiguous()
    m = rows.shape[0]
    x_scale = x_scale.float().reshape(-1, 1).expand(m, 1).contiguous()
    w_scale = w_scale.float().reshape(-1, 1).expand(n, 1).contiguous()
    out = getattr(_aiter(), kernel)(XQ=rows, WQ=weight, x_scale=x_scale, w_scale=w_scale, bias=None, dtype=a.out_dtype)
    return _add_bias(out, a.bias).view(*a.xq.shape[:-1], n)


def _block_scaled_gemm(op: str, args: tuple, kernel: str, x_scale_column_major: bool) -> torch.Tensor:
    """fp8_block_gemm (or its shuffled twin) on AITER's `kernel`, gemm_a8w8_blockscale (x_scale
    row-major [M, K/128]) or gemm_a8w8_blockscale_bpreshuffle (column-major: [K/128, M] in memory,
    viewed [M, K/128], as per_group_quant_hip(transpose_scale=True) writes)."""
    a = named_args(op, args)
    n, k = a.weight.shape
    if gemm_declines(a.xq, a.weight, a.out_dtype) is not None or (a.block_n, a.block_k) != BLOCK or k % a.block_k:
        return next_backend(op, *args)
    xq, x_scale = as_aiter_fp8(a.xq, a.x_scale)
    weight, w_scale = as_aiter_fp8(a.weight, a.weight_scale)
    rows = xq.reshape(-1, k).contiguous()
    m, groups = rows.shape[0], k // a.block_k
    x_scale = x_scale.float().reshape(m, groups)
    x_scale = x_scale.t().contiguous().view(m, groups) if x_scale_column_major else x_scale.contiguous()
    out = getattr(_aiter(), kernel)(
        XQ=rows, WQ=weight, x_scale=x_scale, w_scale=w_scale.float().contiguous(), dtype=a.out_dtype
    )
    return _add_bias(out, a.bias).view(*a.xq.shape[:-1], n)


@bind_as_atomc("atomc_aiter", "fp8_gemm")
def fp8_gemm(*args) -> torch.Tensor:
    return _row_scaled_gemm("fp8_gemm", args, "gemm_a8w8")


@bind_as_atomc("atomc_aiter", "fp8_block_gemm")
def fp8_block_gemm(*args) -> torch.Tensor:
    return _block_scaled_gemm("fp8_block_gemm", args, "gemm_a8w8_blockscale", x_scale_column_major=False)


@bind_as_atomc("atomc_aiter", "fp8_gemm_shuffled")
def fp8_gemm_shuffled(*args) -> torch.Tensor:
    return _row_scaled_gemm("fp8_gemm_shuffled", args, "gemm_a8w8_bpreshuffle")


@bind_as_atomc("atomc_aiter", "fp8_block_gemm_shuffled")
def fp8_block_gemm_shuffled(*args) -> torch.Tensor:
    return _block_scaled_gemm(
        "fp8_block_gemm_shuffled", args, "gemm_a8w8_blockscale_bpreshuffle", x_scale_column_major=True
    )


# ---- the fused quants ----


def _norm_group(k: int, group_size: int) -> int | None:
    """AITER's group_size for an RMSNorm quant (0: one scale a row), or None if none fits."""
    if group_size == k:
        return 0
    if group_size in GROUPS and k % group_size == 0 and k <= MAX_FUSED_ROW:
        return group_size
    return None


def norm_quant_dynamic(x, residual, weight, eps, group_size):
    """(q, scale, x + residual or None) by AITER's fused RMSNorm quant, else AITER's RMSNorm
    (the bf16 bindings' kernels) and the quant above."""
    k = x.shape[-1]
    aiter_group = _norm_group(k, group_size)
    rows = x.reshape(-1, k).contiguous()
    if aiter_group is None or x.dtype not in HALF_DTYPES or rows.shape[0] == 0:
        summed = None if residual is None else x + residual
        q, scale = quant_dynamic(rms_norm_reference(summed if summed is not None else x, weight, eps), group_size)
        return q, scale, summed
    q = torch.empty(rows.shape, dtype=fp8_dtype(), device=x.device)
    scale = torch.empty(rows.shape[0], k // group_size, dtype=torch.float32, device=x.device)
    aiter = _aiter()
    if residual is None:
        aiter.rmsnorm2d_fwd_with_dynamicquant(
            out=q, input=rows, yscale=scale, weight=weight, epsilon=eps, group_size=aiter_group
        )
        summed = None
    else:
        summed = torch.empty_like(rows)
        aiter.rmsnorm2d_fwd_with_add_dynamicquant(
            out=q, input=rows, residual_in=residual.reshape(-1, k).contiguous(), residual_out=summed, yscale=scale,
            weight=weight, epsilon=eps, group_size=aiter_group,
        )  # fmt: skip
        summed = summed.view(x.shape)
    return q.view(x.shape), scale.view(*x.shape[:-1], k // group_size), summed


def norm_quant_static(x, residual, weight, eps, scale):
    """(q, x + residual or None): AITER's RMSNorm (+ add), then its static quant."""
    if x.dtype not in HALF_DTYPES:
        summed = None if residual is None else x + residual
        return quant_static_torch(rms_norm_reference(summed if summed is not None else x, weight, eps), scale), summed
    if residual is None:
        return quant_static(bf16_ops.rms_norm(x, weight, eps), scale), None
    normed, summed = bf16_ops.fused_add_rms_norm(x, residual, weight, eps)
    return quant_static(normed, scale), summed


@bind_as_atomc("atomc_aiter", "rms_norm_fp8_quant_dynamic", fake=_q_in_aiter_dtype)
def rms_norm_fp8_quant_dynamic(
    x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale, _ = norm_quant_dynamic(x, None, weight, eps, group_size)
    return q, scale


@bind_as_atomc("atomc_aiter", "fused_add_rms_norm_fp8_quant_dynamic", fake=_q_in_aiter_dtype)
def fused_add_rms_norm_fp8_quant_dynamic(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return norm_quant_dynamic(x, residual, weight, eps, group_size)


@bind_as_atomc("atomc_aiter", "rms_norm_fp8_quant_static", fake=_q_in_aiter_dtype)
def rms_norm_fp8_quant_static(x: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor) -> torch.Tensor:
    return norm_quant_static(x, None, weight, eps, scale)[0]


@bind_as_atomc("atomc_aiter", "fused_add_rms_norm_fp8_quant_static", fake=_q_in_aiter_dtype)
def fused_add_rms_norm_fp8_quant_static(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return norm_quant_static(x, residual, weight, eps, scale)


def _silu_group_fits(d: int, group_size: int) -> bool:
    return 0 < group_size and d % group_size == 0 and group_size & (group_size - 1) == 0 and d <= MAX_FUSED_ROW


@bind_as_atomc("atomc_aiter", "silu_and_mul_fp8_quant_dynamic", fake=_q_in_aiter_dtype)
def silu_and_mul_fp8_quant_dynamic(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * d).contiguous()
    if x.dtype not in HALF_DTYPES or not _silu_group_fits(d, group_size) or rows.shape[0] == 0:
        return quant_dynamic(silu_and_mul_reference(x), group_size)
    q = torch.empty(rows.shape[0], d, dtype=fp8_dtype(), device=x.device)
    scale = torch.empty(rows.shape[0], d // group_size, dtype=torch.float32, device=x.device)
    _aiter().silu_and_mul_quant(out=q, input=rows, scale=scale, group_size=group_size)
    return q.view(*x.shape[:-1], d), scale.view(*x.shape[:-1], d // group_size)


@bind_as_atomc("atomc_aiter", "silu_and_mul_fp8_quant_static", fake=_q_in_aiter_dtype)
def silu_and_mul_fp8_quant_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    y = bf16_ops.silu_and_mul(x) if x.dtype in HALF_DTYPES else silu_and_mul_reference(x)
    return quant_static(y, scale)


assert set(FUSED_QUANT_OPS) <= set(globals())  # every fused quant has an AITER binding here
