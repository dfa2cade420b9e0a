"""`torch.ops.atomc_aiter.*` for norms, activation and RoPE: atomc ops implemented with AITER (ROCm).
Each takes its atomc op's own schema (atomc/kernels/binding.py), so lowering swaps targets only.
Untested on AMD hardware (see atomc/kernels/aiter/__init__.py). Attention and the ops that write
the KV cache are in attention.py.

Layouts: AITER RMSNorm takes 2-D rows; its RoPE takes [s, b, h, d] with cos/sin [max_pos, 1, 1, d/2]
and positions [s, b].
"""

from __future__ import annotations

import torch

from atomc.kernels.binding import bind_as_atomc


def _aiter():
    import aiter

    return aiter


@bind_as_atomc("atomc_aiter", "rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return _aiter().rmsnorm2d_fwd(input=rows, weight=weight, epsilon=eps).view(x.shape)


@bind_as_atomc("atomc_aiter", "fused_add_rms_norm")
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    res = residual.reshape(-1, x.shape[-1]).contiguous()
    out, res_out = torch.empty_like(rows), torch.empty_like(rows)
    _aiter().rmsnorm2d_fwd_with_add(
        out=out, input=rows, residual_in=res, residual_out=res_out, weight=weight, epsilon=eps
    )
    return out.view(x.shape), res_out.view(x.shape)


@bind_as_atomc("atomc_aiter", "silu_and_mul")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
    _aiter().silu_and_mul(out=out, input=x.contiguous())
    return out


def rope_rows(positions, q, k, cos_sin_cache):
    """Neox RoPE of q [T, Hq, D] and k [T, Hkv, D] by AITER's cached-positions kernel; new tensors."""
    half = cos_sin_cache.shape[-1] // 2
    # neox halves: the first d/2 of the table are cos, the rest sin, reused for both halves of x
    cos = cos_sin_cache[:, :half].to(q.dtype).view(-1, 1, 1, half)
    sin = cos_sin_cache[:, half:].to(q.dtype).view(-1, 1, 1, half)
    q_out, k_out = _aiter().rope_cached_positions_2c_fwd(
        input_x=q.unsqueeze(1).contiguous(),  # [s, b=1, h, d]
        input_y=k.unsqueeze(1).contiguous(),
        cos=cos,
        sin=sin,
        positions=positions.view(-1, 1).contiguous(),
        rotate_style=0,  # NEOX (rotate-half)
        reuse_freqs_front_part=True,
        nope_first=False,
        transpose_output=False,
    )
    return q_out.squeeze(1), k_out.squeeze(1)


@bind_as_atomc("atomc_aiter", "rope")
def rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_rows(positions, q, k, cos_sin_cache)
