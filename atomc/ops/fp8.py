"""FP8 (e4m3) linears as atomc ops: the activation quant and the scaled GEMM are separate ops.

A quantised linear is `fp8_quant_* -> fp8_gemm` (or `fp8_block_gemm`) in the graph, never F.linear,
so the passes that match F.linear leave it alone, and the quant is its own node: the FP8 passes
(share_fp8_quant, fuse_rmsnorm_fp8_quant, fuse_silu_mul_fp8_quant; the fused ops are fp8_fused.py)
match and replace just that node, and the GEMM's backend does not change.

- `fp8_quant_static(x, scale)`: x / scale with a checkpoint's per-tensor scale.
- `fp8_quant_dynamic(x, group_size)`: scales from x itself: `group_size` 0 -> one for the tensor
  ([1]); g > 0 -> one per g consecutive values of a row ([..., K/g]; g = K is per token).
- `fp8_gemm(xq, x_scale, w, w_scale, bias, out_dtype)`: x_scale [1] or [T, 1], w_scale [1] or [N]
  (per output row: per-channel weights, or the per-shard scales of a merged layer laid out by row).
- `fp8_block_gemm(xq, x_scale, w, w_scale, block_n, block_k, bias, out_dtype)`: x_scale [T, K/bk]
  (per token group), w_scale [ceil(N/bn), ceil(K/bk)] (per weight block).

The bodies are exact dequantising references in fp32 (dequantise both operands, multiply): what the
CPU runs and what every kernel is tested against. GPU kernels are backends (atomc/kernels/).

Two e4m3 dtypes: atomc's quants write float8_e4m3fn (max 448); MI300 (gfx942) computes in
float8_e4m3fnuz (max 240, exponent bias 8, no -0, 0x80 is NaN). A pair (q, scale) means
q.float() * scale in either dtype, so the reference bodies read both. `fn_to_fnuz` moves a pair
across exactly: the same bits read as fnuz are half the value, so the scale doubles; the one byte
that differs in meaning, 0x80 (-0 in fn, NaN in fnuz), becomes 0.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
FNUZ_DTYPE = torch.float8_e4m3fnuz  # MI300's e4m3 (see the module docstring)
MIN_SCALE = 1e-12  # an all-zero row or tensor quantises to zeros, not NaN


def fn_to_fnuz(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn q, scale) -> the same values as (float8_e4m3fnuz q, 2 * scale); new tensors."""
    bits = q.view(torch.int8)
    bits = torch.where(bits == -128, torch.zeros_like(bits), bits)  # -0 in fn, NaN in fnuz
    return bits.view(FNUZ_DTYPE), scale * 2.0


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to e4m3, saturating (fp8_quant_static's body)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


@torch.library.custom_op("atomc::fp8_quant_static", mutates_args=())
def fp8_quant_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> float8_e4m3fn with the per-tensor `scale` [1] (x ~ q * scale)."""
    return to_fp8(x, scale.float())


@fp8_quant_static.register_fake
def _(x, scale):
    return torch.empty_like(x, dtype=FP8_DTYPE)


def dynamic_scale_shape(shape, group_size: int) -> list:
    if group_size == 0:
        return [1]
    return [*shape[:-1], shape[-1] // group_size]


@torch.library.custom_op("atomc::fp8_quant_dynamic", mutates_args=())
def fp8_quant_dynamic(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q float8_e4m3fn [..., K], scale float32): amax / 448 per tensor or per group."""
    return fp8_quant_dynamic_reference(x, group_size)


def fp8_quant_dynamic_reference(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_quant_dynamic's body as a plain function (backends and fused references call it)."""
    xf = x.float()
    if group_size == 0:
        scale = (xf.abs().amax() / FP8_MAX).clamp(min=MIN_SCALE).reshape(1)
        return to_fp8(xf, scale), scale
    k = x.shape[-1]
    if group_size < 0 or k % group_size:
        raise ValueError(f"fp8_quant_dynamic: group size {group_size} does not divide the row length {k}")
    groups = xf.unflatten(-1, (k // group_size, group_size))
    scale = (groups.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    q = to_fp8(groups, scale).flatten(-2)
    return q, scale.squeeze(-1)


@fp8_quant_dynamic.register_fake
def _(x, group_size):
    q = torch.empty_like(x, dtype=FP8_DTYPE)
    return q, x.new_empty(dynamic_scale_shape(x.shape, group_size), dtype=torch.float32)


@torch.library.custom_op("atomc::fp8_gemm", mutates_args=())
def fp8_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(xq * x_scale) @ (weight * weight_scale[:, None]).T + bias: [..., K] x [N, K] -> [..., N]."""
    return fp8_gemm_reference(xq, x_scale, weight, weight_scale, bias, out_dtype)


def fp8_gemm_reference(xq, x_scale, weight, weight_scale, bias, out_dtype):
    """fp8_gemm's body as a plain function (a backend's fallback calls it without dispatching)."""
    x = xq.float() * x_scale.float()
    w = weight.float() * weight_scale.float().reshape(-1, 1)
    out = x @ w.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


@fp8_gemm.register_fake
def fp8_gemm_fake(xq, x_scale, weight, weight_scale, bias, out_dtype):
    return xq.new_empty(*xq.shape[:-1], weight.shape[0], dtype=out_dtype)


def expand_block_scale(scale: torch.Tensor, block_n: int, block_k: int, n: int, k: int) -> torch.Tensor:
    """[ceil(n/bn), ceil(k/bk)] -> [n, k]: each block's scale on every value it covers."""
    return scale.float().repeat_interleave(block_n, 0)[:n].repeat_interleave(block_k, 1)[:, :k]


@torch.library.custom_op("atomc::fp8_block_gemm", mutates_args=())
def fp8_block_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_n: int,
    block_k: int,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Block-scaled FP8 GEMM: x_scale [..., K/block_k] per token group, weight_scale per block."""
    return fp8_block_gemm_reference(xq, x_scale, weight, weight_scale, block_n, block_k, bias, out_dtype)


def fp8_block_gemm_reference(xq, x_scale, weight, weight_scale, block_n, block_k, bias, out_dtype):
    """fp8_block_gemm's body as a plain function."""
    n, k = weight.shape
    x = xq.float() * x_scale.float().repeat_interleave(block_k, -1)[..., :k]
    w = weight.float() * expand_block_scale(weight_scale, block_n, block_k, n, k)
    out = x @ w.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


@fp8_block_gemm.register_fake
def fp8_block_gemm_fake(xq, x_scale, weight, weight_scale, block_n, block_k, bias, out_dtype):
    return fp8_gemm_fake(xq, x_scale, weight, weight_scale, bias, out_dtype)
