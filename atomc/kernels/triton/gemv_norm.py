"""One-row GEMV whose last program to finish adds the residual and runs the RMSNorm (and the FP8 quant).

At batch 1 a decoder layer's o projection is a GEMV of some hundreds of programs, and the residual
add + RMSNorm after it is a kernel of one program: its launch and start cost more than its work.
Here each GEMV program stores its rows of y and `arrive`s (arrivals.py); the program that draws the
last ticket reads the whole row y back from L2 (`.cg`: past its own L1), adds the residual, and
writes the normalised row (bf16, or e4m3 with its dynamic scale) and the residual sum, exactly as
`fused_add_rms_norm` / `fused_add_rms_norm_fp8_quant_dynamic` would from y.

The GEMV part is the one-row kernel the unfused linear runs, on the same tile: `gemv.row_dot`
(bf16, `gemv.reduce_config`) or `fp8_gemv.scaled_row_dot` (e4m3 x and weights, per-tensor or
per-row scales, the CUDA-core loops of fp8_gemv.py's picked tile). Where those do not apply (more
than one row, the picked FP8 tile is the tensor-core one, block scales, dtypes that differ, no
counter: the first call under a CUDA-graph capture) the functions return None and the caller runs
the two kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomc.kernels.triton import arrivals, fp8_gemv, pdl
from atomc.kernels.triton.arrivals import arrive, reset
from atomc.kernels.triton.fp8_gemv import scaled_row_dot
from atomc.kernels.triton.fp8_quant import ROUND_IN_FP32, _quantize_store, _tile
from atomc.kernels.triton.gemv import reduce_config, row_dot
from atomc.kernels.triton.packed_f16 import e4m3_x_shift
from atomc.ops import fp8 as fp8_ref

MAX_ROW = 1 << 14  # the last program holds the whole normalised row in registers


@triton.jit
def _add_rms_norm_row(
    y_ptr, res_ptr, nw_ptr, out_ptr, res_out_ptr, s_ptr, n_cols, n_groups, eps,
    QUANT: tl.constexpr, NG: tl.constexpr, G: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
):  # fmt: skip
    """The row y [n_cols] (written by every program of this launch) plus the residual, rounded to
    the residual's dtype and stored; its RMSNorm times the weight with HF's roundings (as
    rmsnorm.py and fp8_quant.py's norm kernel), stored, or (QUANT) quantised per group of G."""
    gidx = tl.arange(0, NG)
    offs = gidx[:, None] * G + tl.arange(0, G)[None, :]
    ok = offs < n_cols
    dtype = res_out_ptr.dtype.element_ty
    y = tl.load(y_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg")
    r = tl.load(res_ptr + offs, mask=ok, other=0.0)
    x = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)
    tl.store(res_out_ptr + offs, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(tl.sum(xf * xf, 1), 0) / n_cols + eps)
    w = tl.load(nw_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    normed = (xf * rstd).to(dtype).to(tl.float32) * w
    if QUANT:
        normed = normed.to(dtype).to(tl.float32)
        _quantize_store(normed, offs, ok, gidx, n_groups, out_ptr, s_ptr, s_ptr, False, ROUND_IN_FP32)
    else:
        tl.store(out_ptr + offs, normed.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gemv_add_norm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, res_ptr, nw_ptr, out_ptr, res_out_ptr, s_ptr, counter_ptr,
    N, K, stride_wn, n_groups, eps,
    FP8: tl.constexpr, WS_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr, F16_SUMS: tl.constexpr, X_SHIFT: tl.constexpr,
    QUANT: tl.constexpr, NG: tl.constexpr, G: tl.constexpr, ROUND_IN_FP32: tl.constexpr,
):  # fmt: skip
    """y = x . W^T (+ b) over this program's BLOCK_N rows (bf16: row_dot; FP8: scaled_row_dot), then
    the add + norm (+ quant) of the whole row by the last program to arrive. PDL: the row loop waits
    (pdl.py) before it reads x; the residual is read after that."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if FP8:
        y = scaled_row_dot(x_ptr, xs_ptr, w_ptr, ws_ptr, offs_n, n_ok, K, stride_wn,
                           WS_ROWS, BLOCK_N, BLOCK_K, PDL, F16_SUMS, X_SHIFT)  # fmt: skip
    else:
        y = row_dot(x_ptr, w_ptr, offs_n, n_ok, K, stride_wn, BLOCK_N, BLOCK_K, PDL)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)
    if arrive(counter_ptr) == tl.num_programs(0) - 1:
        reset(counter_ptr)
        _add_rms_norm_row(y_ptr, res_ptr, nw_ptr, out_ptr, res_out_ptr, s_ptr, N, n_groups, eps,
                          QUANT, NG, G, ROUND_IN_FP32)  # fmt: skip


def _counter(device: torch.device) -> torch.Tensor | None:
    found = arrivals.counters(device, "gemv_add_norm")
    return found[:1] if found is not None else None


def _one_row(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return (
        x.numel() == k
        and residual.numel() == n
        and weight.stride(-1) == 1
        and norm_weight.dtype == residual.dtype
        and n <= MAX_ROW
    )


def _launch(x, xs, weight, ws, bias, y, residual, norm_weight, out, summed, s, eps, group_size, tile, block_k,
            **consts):  # fmt: skip
    """group_size 0: no quant (out in the residual's dtype)."""
    n, k = weight.shape
    counter = _counter(x.device)
    ng, g = _tile(n, group_size, whole_row=True) if group_size else (1, triton.next_power_of_2(n))
    _gemv_add_norm_kernel[(triton.cdiv(n, tile["block_n"]),)](
        x, xs, weight, ws, bias if bias is not None else weight, y, residual, norm_weight, out, summed, s, counter,
        n, k, weight.stride(0), n // group_size if group_size else 1, eps,
        HAS_BIAS=bias is not None, BLOCK_N=tile["block_n"], BLOCK_K=block_k, QUANT=bool(group_size), NG=ng, G=g,
        ROUND_IN_FP32=ROUND_IN_FP32, num_warps=tile["num_warps"], num_stages=tile.get("num_stages", 4),
        **consts, **pdl.launch(x),
    )  # fmt: skip


def linear_add_rms_norm(x, weight, bias, residual, norm_weight, eps):
    """(rms_norm(x . W^T + b + residual), x . W^T + b + residual) for one row x on the reduce GEMV's
    tile, or None where the fused kernel does not apply."""
    if not _one_row(x, weight, residual, norm_weight) or not x.dtype == weight.dtype == residual.dtype:
        return None
    if _counter(x.device) is None:
        return None
    n, k = weight.shape
    x1 = x.reshape(k).contiguous()
    r1 = residual.reshape(n).contiguous()
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    out = torch.empty_like(residual, dtype=torch.promote_types(residual.dtype, norm_weight.dtype))
    summed = torch.empty_like(residual)
    tile = reduce_config(n, k)
    block_k = min(tile["block_k"], max(16, triton.next_power_of_2(k)))  # as gemv.gemv's reduce kernel
    _launch(x1, x1, weight, x1, bias, y, r1, norm_weight, out, summed, out, eps, 0, tile, block_k,
            FP8=False, WS_ROWS=False, F16_SUMS=False, X_SHIFT=1.0)  # fmt: skip
    return out, summed


def fp8_gemv_add_rms_norm_quant(
    xq, x_scale, weight, weight_scale, bias, out_dtype, residual, norm_weight, eps, group_size, knobs=None
):
    """(q, scale, summed) of the dynamic per-group FP8 quant of rms_norm(y + residual), y = the FP8
    GEMV of one e4m3 row (per-tensor or per-row scales; out_dtype the residual's), or None where
    the fused kernel does not apply (fp8_gemv would run its tensor-core tile, a group the norm
    quant kernel does not take). `knobs`: fp8_gemv's tuning keywords (kernel, block_n, ...)."""
    n, k = weight.shape
    if not _one_row(xq, weight, residual, norm_weight) or out_dtype != residual.dtype:
        return None
    if _tile(n, group_size, whole_row=True) is None:
        return None
    tile = fp8_gemv.one_row_config(n, k, None, xq.device, knobs or {})
    if tile["kernel"] not in fp8_gemv.CUDA_CORE_KERNELS or weight_scale.numel() not in (1, n):
        return None
    if _counter(xq.device) is None:
        return None
    x1 = xq.reshape(k)
    x1 = x1 if x1.stride(0) == 1 else x1.contiguous()
    r1 = residual.reshape(n).contiguous()
    y = torch.empty(n, dtype=residual.dtype, device=xq.device)
    q = torch.empty(residual.shape, dtype=fp8_ref.FP8_DTYPE, device=xq.device)
    s = torch.empty(fp8_ref.dynamic_scale_shape(residual.shape, group_size), dtype=torch.float32, device=xq.device)
    summed = torch.empty_like(residual)
    f16 = tile["kernel"] == "reduce_f16"
    block_k = min(tile["block_k"], triton.next_power_of_2(k))
    _launch(x1, x_scale.float().reshape(-1), weight, weight_scale.float().reshape(-1), bias, y, r1, norm_weight,
            q, summed, s, eps, group_size, tile, block_k, FP8=True, WS_ROWS=weight_scale.numel() > 1, F16_SUMS=f16,
            X_SHIFT=e4m3_x_shift(k, block_k) if f16 else 1.0)  # fmt: skip
    return q, s, summed
