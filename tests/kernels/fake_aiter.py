"""A stand-in `aiter` module for CPU tests. Its functions take keyword arguments only, with the
names of AITER's real signatures (/work notes: kernels.md), so a wrapper that passes an argument
positionally or misnames one fails here; each asserts the layouts AITER expects and computes the
reference in plain torch."""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

CALLS: list[str] = []


def _norm(x, weight, eps):
    xf = x.float()
    return (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)).to(x.dtype)


def rmsnorm2d_fwd(*, input, weight, epsilon):
    CALLS.append("rmsnorm2d_fwd")
    assert input.dim() == 2, "AITER RMSNorm takes rows"
    return _norm(input, weight, epsilon)


def rmsnorm2d_fwd_with_add(*, out, input, residual_in, residual_out, weight, epsilon):
    CALLS.append("rmsnorm2d_fwd_with_add")
    assert input.dim() == 2 and input.shape == residual_in.shape == out.shape == residual_out.shape
    residual_out.copy_(input + residual_in)
    out.copy_(_norm(residual_out, weight, epsilon))


def silu_and_mul(*, out, input, limit=0.0):
    CALLS.append("silu_and_mul")
    gate, up = input.chunk(2, dim=-1)
    out.copy_(F.silu(gate) * up)


def rope_cached_positions_2c_fwd(
    *, input_x, input_y, cos, sin, positions, rotate_style, reuse_freqs_front_part, nope_first,
    transpose_output=False,
):  # fmt: skip
    CALLS.append("rope_cached_positions_2c_fwd")
    s, b = input_x.shape[:2]
    assert input_x.dim() == input_y.dim() == 4 and positions.shape == (s, b)
    assert cos.dim() == 4 and cos.shape[1:3] == (1, 1) and cos.shape[-1] * 2 == input_x.shape[-1]
    assert rotate_style == 0 and reuse_freqs_front_part and not nope_first and not transpose_output
    c = cos[positions.long()].squeeze(-2).squeeze(-2)  # [s, b, d/2]
    sn = sin[positions.long()].squeeze(-2).squeeze(-2)
    c, sn = c.unsqueeze(-2), sn.unsqueeze(-2)

    def rot(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * c - x2 * sn, x2 * c + x1 * sn], dim=-1)

    return rot(input_x), rot(input_y)


def reshape_and_cache_flash(
    *, key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, kv_layout=-1
):
    CALLS.append("reshape_and_cache_flash")
    assert key_cache.dim() == 4 and kv_cache_dtype == "auto"  # NHD pages [blocks, page, kvh, d]
    keep = slot_mapping >= 0
    key_cache.view(-1, *key_cache.shape[2:])[slot_mapping[keep]] = key[: slot_mapping.numel()][keep]
    value_cache.view(-1, *value_cache.shape[2:])[slot_mapping[keep]] = value[: slot_mapping.numel()][keep]


def module() -> types.ModuleType:
    mod = types.ModuleType("aiter")
    for fn in (rmsnorm2d_fwd, rmsnorm2d_fwd_with_add, silu_and_mul, rope_cached_positions_2c_fwd,
               reshape_and_cache_flash):  # fmt: skip
        setattr(mod, fn.__name__, fn)
    return mod
