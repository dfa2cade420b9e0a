"""Rotary position embedding (neox rotate-half) from a cos/sin table, with linear and llama3 scaling.

The forward is the form the canonicalize pass's rope pattern matches (and atomc.ops.rope repeats op
for op): keep it written this way. `rope_parameters` reads both config spellings, old
(`rope_theta`, `rope_scaling`) and new (`rope_parameters`), whatever transformers wrote the file.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_parameters(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling or None for plain RoPE) from a config.json dict."""
    rope = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    _scaling_kind(scaling)  # an unsupported kind fails here, at config parsing, not after the load
    return float(theta), scaling


SCALING_KINDS = ("default", "linear", "llama3")


def _scaling_kind(scaling: dict | None) -> str:
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind not in SCALING_KINDS:
        raise ValueError(f"rope scaling {kind!r} is not supported (supported: {', '.join(SCALING_KINDS)})")
    return kind


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = _scaling_kind(scaling)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate between
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE over a flat batch, from a cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.register_buffer("cos_sin", torch.empty(max_positions, head_dim), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        if self.cos_sin.is_meta:
            return
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(self.cos_sin.device)
        freqs = torch.outer(torch.arange(self.max_positions, device=inv_freq.device).float(), inv_freq)
        self.cos_sin.copy_(torch.cat([freqs.cos(), freqs.sin()], dim=-1))

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hkv, D]."""
        cos, sin = self.cos_sin[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)
