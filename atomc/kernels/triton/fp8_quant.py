"""FP8 (e4m3) activation quant kernels: plain, after RMSNorm (+ residual add), after SiLU·mul.

One program takes a row (or, where the scale allows, a column block of a row) as an [NG, G] tile:
G values per scale group, NG groups. The value is computed in fp32, rounded to the activation dtype
where the unfused graph rounds it (the norm and activation outputs are bf16 tensors there), then
divided by its scale and rounded to e4m3 (saturating at ±448). The scale is the group's amax / 448
(dynamic) or the checkpoint's (static), exactly as atomc/ops/fp8.py computes it, so a fused kernel
writes what `fp8_quant_*` would have written from the unfused output.

- per token (group_size = K): G = next_pow2(K), NG = 1, one program a row;
- per group (a power-of-two group_size < K, 128 for block FP8): G = group_size;
- static: one scale for everything, so the SiLU and plain kernels tile the row freely.
A norm needs the whole row for its statistic, so its kernels always take one row a program.
`group_size` 0 (one dynamic scale for the whole tensor) is the plain kernel after a torch amax.
Anything else (a group that is not a power of two, mismatched dtypes) runs the reference.

The fp32 -> e4m3 cast is the hardware's (round to nearest even) on the GPU. Triton's interpreter
(3.x) gets it wrong where rounding carries into the exponent (124.3 -> 64 instead of 128), so under
TRITON_INTERPRET=1 the kernels first round to the e4m3 grid in fp32 arithmetic (ROUND_IN_FP32, a
kernel parameter) and the cast is then exact: the interpreter tests check the kernels' scales,
layout and masking that way, and the GPU tests check the hardware cast.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from atomc.kernels.triton import pdl
from atomc.kernels.triton.pdl import after_producer
from atomc.ops import fp8 as ref

FP8_MAX = ref.FP8_MAX
MIN_SCALE = ref.MIN_SCALE
TILE = 1024  # values a program takes when the scale does not need the whole row
ROUND_IN_FP32 = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _round_to_e4m3_grid(q):
    """q (|q| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32 arithmetic: the step
    is 2^(e - 3) for a normal value of exponent e (3 mantissa bits), 2^-9 below 2^-6 (subnormals).
    Adding and removing 1.5 * 2^23 rounds q / step (below 16) to an integer, ties to even."""
    bits = q.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 255) - 127, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    r = ((tl.abs(q) / step + 12582912.0) - 12582912.0) * step
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)  # q's sign, -0 too


@triton.jit
def _amax_scale(amax):
    """A dynamic scale: amax / 448, floored at 1e-12 (ref.MIN_SCALE)."""
    # div_rn: IEEE division, as torch divides; Triton's `/` on fp32 is the GPU's approximate
    # division (up to 2 ulp), which moves values across e4m3 rounding boundaries
    return tl.maximum(tl.div_rn(amax, 448.0), 1e-12)


@triton.jit
def _store_e4m3(q_ptr, offs, y, s, ok, ROUND_IN_FP32: tl.constexpr):
    """y / s (IEEE division), saturated at +-448 and cast to e4m3, stored at q_ptr + offs."""
    q = tl.minimum(tl.maximum(tl.div_rn(y, s), -448.0), 448.0)
    if ROUND_IN_FP32:  # the interpreter's own fp32 -> e4m3 cast is wrong (module docstring)
        q = _round_to_e4m3_grid(q)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul(x, u, dtype: tl.constexpr):
    """silu(x) * u in fp32 (x, u fp32), rounded once to `dtype` (as atomc/kernels/triton/activation.py)."""
    return (x / (1.0 + tl.exp(-x)) * u).to(dtype)


@triton.jit
def _quantize_store(
    y, offs, ok, gidx, n_groups, q_row, s_row, scale_ptr, STATIC: tl.constexpr, ROUND_IN_FP32: tl.constexpr
):
    """y [NG, G] fp32 (masked entries 0) -> e4m3 at q_row + offs, and (dynamic) its group scales."""
    if STATIC:
        _store_e4m3(q_row, offs, y, tl.load(scale_ptr), ok, ROUND_IN_FP32)
    else:
        s = _amax_scale(tl.max(tl.abs(y), 1))
        tl.store(s_row + gidx, s, mask=gidx < n_groups)
        _store_e4m3(q_row, offs, y, s[:, None], ok, ROUND_IN_FP32)


@triton.jit
def _norm_quant_kernel(
    x_ptr, res_ptr, w_ptr, res_out_ptr, q_ptr, s_ptr, scale_ptr,
    stride_x, stride_r, stride_ro, n_cols, n_groups, eps,
    ADD: tl.constexpr, STATIC: tl.constexpr, NG: tl.constexpr, G: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    gidx = tl.arange(0, NG)
    offs = gidx[:, None] * G + tl.arange(0, G)[None, :]
    ok = offs < n_cols
    w = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)  # a weight: before the wait (pdl.py)
    after_producer(PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    if ADD:
        r = tl.load(res_ptr + row * stride_r + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # the residual rounds to dtype
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(tl.sum(xf * xf, 1), 0) / n_cols + eps)
    # HF rounding, as atomc::rms_norm: normalise in fp32, cast, times the weight, cast
    y = ((xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32) * w).to(x_ptr.dtype.element_ty).to(tl.float32)
    _quantize_store(
        y, offs, ok, gidx, n_groups, q_ptr + row * n_cols, s_ptr + row * n_groups, scale_ptr, STATIC, ROUND_IN_FP32
    )


@triton.jit
def _rows_quant_kernel(
    x_ptr, q_ptr, s_ptr, scale_ptr, stride_x, n_cols, n_groups,
    SILU: tl.constexpr, STATIC: tl.constexpr, NG: tl.constexpr, G: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Plain quant of x [rows, n_cols], or (SILU) of silu(x[:, :n_cols]) * x[:, n_cols:]."""
    after_producer(PDL)  # pdl.py
    row = tl.program_id(0).to(tl.int64)
    gidx = tl.program_id(1) * NG + tl.arange(0, NG)
    offs = gidx[:, None] * G + tl.arange(0, G)[None, :]
    ok = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    if SILU:
        u = tl.load(x_ptr + row * stride_x + n_cols + offs, mask=ok, other=0.0).to(tl.float32)
        x = _silu_mul(x, u, x_ptr.dtype.element_ty).to(tl.float32)
    _quantize_store(
        x, offs, ok, gidx, n_groups, q_ptr + row * n_cols, s_ptr + row * n_groups, scale_ptr, STATIC, ROUND_IN_FP32
    )


@triton.jit
def _silu_mul_amax_kernel(
    x_ptr, h_ptr, amax_ptr, stride_x, n_cols, n_chunks, CHUNK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Split per-token path, step 1: silu(x[:, :n_cols]) * x[:, n_cols:] of one chunk, rounded to
    the dtype as the one-program kernel rounds it, into h, and the chunk's amax."""
    after_producer(PDL)  # pdl.py
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n_cols + offs, mask=ok, other=0.0).to(tl.float32)
    y = _silu_mul(x, u, x_ptr.dtype.element_ty)
    tl.store(h_ptr + row * n_cols + offs, y, mask=ok)
    tl.store(amax_ptr + row * n_chunks + chunk, tl.max(tl.abs(y.to(tl.float32)), 0))


@triton.jit
def _quant_by_chunk_amax_kernel(
    h_ptr, amax_ptr, q_ptr, s_ptr, n_cols, n_chunks,
    CHUNK: tl.constexpr, CHUNKS: tl.constexpr, ROUND_IN_FP32: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Step 2: the row's scale from its chunks' amax (the row's amax: the same scale the one-program
    kernel computes), then this chunk quantised with it."""
    after_producer(PDL)  # pdl.py
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    c = tl.arange(0, CHUNKS)
    amax = tl.max(tl.load(amax_ptr + row * n_chunks + c, mask=c < n_chunks, other=0.0), 0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ok = offs < n_cols
    y = tl.load(h_ptr + row * n_cols + offs, mask=ok, other=0.0).to(tl.float32)
    s = _amax_scale(amax)
    if chunk == 0:
        tl.store(s_ptr + row, s)
    _store_e4m3(q_ptr + row * n_cols, offs, y, s, ok, ROUND_IN_FP32)


# per-token SiLU·mul quant of a few rows: one program a row is one SM doing a 14336-wide row (6.7 us
# on an H200 at Llama-3.1-8B's width, benchmarks/fp8_quant_kernels.py); split into chunks of
# SPLIT_CHUNK over two launches (the row's amax between them) when rows <= SPLIT_MAX_ROWS
SPLIT_CHUNK = 2048
SPLIT_MAX_ROWS = 8


def _silu_quant_split(x2, k):
    rows = x2.shape[0]
    chunks = triton.cdiv(k, SPLIT_CHUNK)
    h = torch.empty(rows, k, dtype=x2.dtype, device=x2.device)
    amax = torch.empty(rows, chunks, dtype=torch.float32, device=x2.device)
    q, s, _ = _outputs(x2, k, k)
    warps = _num_warps(SPLIT_CHUNK)
    _silu_mul_amax_kernel[(rows, chunks)](
        x2, h, amax, x2.stride(0), k, chunks, CHUNK=SPLIT_CHUNK, num_warps=warps, **pdl.launch(x2)
    )
    _quant_by_chunk_amax_kernel[(rows, chunks)](
        h, amax, q, s, k, chunks,
        CHUNK=SPLIT_CHUNK, CHUNKS=triton.next_power_of_2(chunks), ROUND_IN_FP32=ROUND_IN_FP32, num_warps=warps,
        **pdl.launch(x2),
    )  # fmt: skip
    return q, s


def _tile(k: int, group_size: int | None, whole_row: bool) -> tuple[int, int] | None:
    """(NG, G) for a row of k values: group_size None is static, k per token; None if unsupported."""
    if group_size is None:
        g = triton.next_power_of_2(k) if whole_row else min(TILE, triton.next_power_of_2(k))
        return 1, g
    if group_size == k:
        return 1, triton.next_power_of_2(k)
    if group_size <= 0 or k % group_size or group_size & (group_size - 1):
        return None
    groups = k // group_size
    ng = (
        triton.next_power_of_2(groups) if whole_row else min(triton.next_power_of_2(groups), max(1, TILE // group_size))
    )
    return ng, group_size


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _outputs(x2, k, group_size):
    q = torch.empty(x2.shape[0], k, dtype=ref.FP8_DTYPE, device=x2.device)
    n_groups = 1 if group_size is None else k // group_size
    s = torch.empty(x2.shape[0], n_groups, dtype=torch.float32, device=x2.device)
    return q, s, n_groups


def _num_warps(values: int) -> int:
    return min(16, max(1, values // 512))


def _norm_quant(x, residual, weight, eps, scale, group_size, num_warps=None):
    """(q, scale or None, summed or None) through the kernel, or None where it does not apply."""
    k = x.shape[-1]
    tile = _tile(k, group_size, whole_row=True)
    if tile is None or weight.dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
        return None
    ng, g = tile
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    summed = torch.empty_like(x2) if residual is not None else x2
    q, s, n_groups = _outputs(x2, k, group_size)
    if x2.shape[0]:
        _norm_quant_kernel[(x2.shape[0],)](
            x2, r2, weight, summed, q, s, scale if scale is not None else s,
            x2.stride(0), r2.stride(0), summed.stride(0), k, n_groups, eps,
            ADD=residual is not None, STATIC=scale is not None, NG=ng, G=g, ROUND_IN_FP32=ROUND_IN_FP32,
            num_warps=num_warps or _num_warps(ng * g), **pdl.launch(x2),
        )  # fmt: skip
    lead = x.shape[:-1]
    return (
        q.view(*lead, k),
        s.view(*lead, n_groups) if scale is None else None,
        summed.view(x.shape) if residual is not None else None,
    )


def _rows_quant(x, scale, group_size, silu: bool, num_warps=None):
    k = x.shape[-1] // 2 if silu else x.shape[-1]
    tile = _tile(k, group_size, whole_row=False)
    if tile is None:
        return None
    ng, g = tile
    x2 = _rows(x)
    lead = x.shape[:-1]
    per_token = scale is None and group_size == k
    if silu and per_token and num_warps is None and 0 < x2.shape[0] <= SPLIT_MAX_ROWS and k > SPLIT_CHUNK:
        q, s = _silu_quant_split(x2, k)
        return q.view(*lead, k), s.view(*lead, 1)
    q, s, n_groups = _outputs(x2, k, group_size)
    if x2.shape[0]:
        grid = (x2.shape[0], triton.cdiv(k, ng * g))
        _rows_quant_kernel[grid](
            x2, q, s, scale if scale is not None else s, x2.stride(0), k, n_groups,
            SILU=silu, STATIC=scale is not None, NG=ng, G=g, ROUND_IN_FP32=ROUND_IN_FP32,
            num_warps=num_warps or _num_warps(ng * g), **pdl.launch(x2),
        )  # fmt: skip
    return q.view(*lead, k), s.view(*lead, n_groups)


# ---- the ops' bodies (atomc/kernels/triton/fp8.py binds them) ----


def quant_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _rows_quant(x, scale.float(), None, silu=False)[0]


def quant_dynamic(x: torch.Tensor, group_size: int, num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if group_size == 0:  # one scale for the tensor: its amax first (a torch reduction), then the static kernel
        scale = (x.abs().amax().float() / FP8_MAX).clamp(min=MIN_SCALE).reshape(1)
        return quant_static(x, scale), scale
    out = _rows_quant(x, None, group_size, silu=False, num_warps=num_warps)
    # the plain reference (the op itself would dispatch back here on CUDA)
    return out if out is not None else ref.fp8_quant_dynamic_reference(x, group_size)


def silu_and_mul_quant(x: torch.Tensor, scale: torch.Tensor | None, group_size: int | None, num_warps=None):
    """(q, scale [.., groups]) of silu(gate) * up, or None where the kernel does not apply.
    `num_warps` (here and below): a tuning knob for benchmarks/fp8_quant_kernels.py."""
    return _rows_quant(x, None if scale is None else scale.float(), group_size, silu=True, num_warps=num_warps)


def rms_norm_quant(x, residual, weight, eps: float, scale: torch.Tensor | None, group_size: int | None, num_warps=None):
    """(q, dynamic scale or None, x + residual or None), or None where the kernel does not apply."""
    return _norm_quant(x, residual, weight, eps, None if scale is None else scale.float(), group_size, num_warps)
