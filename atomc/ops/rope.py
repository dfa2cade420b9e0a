"""`atomc::rope`: Neox-style (rotate-half) RoPE of q and k from a [max_pos, D] cos|sin table.

The reference repeats models.layers.rotary.RotaryEmbedding op for op, so the rewrite is bit-identical.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope_reference(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@torch.library.custom_op("atomc::rope", mutates_args=())
def rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T]; q [T, Hq, D]; k [T, Hkv, D]; cos_sin_cache [max_pos, D] (cos half | sin half)."""
    return rope_reference(positions, q, k, cos_sin_cache)


@rope.register_fake
def _(positions, q, k, cos_sin_cache):
    return torch.empty_like(q), torch.empty_like(k)
