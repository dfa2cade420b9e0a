"""Rotary position embedding (neox rotate-half) from a cos/sin table, with linear, llama3 and YaRN
scaling. YaRN (GPT-OSS) also scales the table itself by its attention factor (mscale), so the
forward and the fused kernels, which read the table, need no change.

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


SCALING_KINDS = ("default", "linear", "llama3", "yarn")


def _scaling_kind(scaling: dict | None) -> str:
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind not in SCALING_KINDS:
        raise ValueError(f"rope scaling {kind!r} is not supported (supported: {', '.join(SCALING_KINDS)})")
    return kind


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None, max_positions: int | None = None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = _scaling_kind(scaling)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, _yarn_factor(scaling, max_positions), scaling)
    return inv_freq


def rope_attention_factor(scaling: dict | None, max_positions: int | None = None) -> float:
    """What the cos/sin table is multiplied by: 1, except for YaRN (its `attention_factor`, else
    0.1 * ln(factor) + 1, or the ratio of two such terms when `mscale` and `mscale_all_dim` are set)."""
    if _scaling_kind(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling, max_positions)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_factor(s: dict, max_positions: int | None) -> float:
    if s.get("factor") is not None:
        return float(s["factor"])
    if max_positions is None:  # DeepSeek-style configs: the context extension is the factor
        raise ValueError("yarn rope scaling without `factor` needs max_position_embeddings")
    return max_positions / s["original_max_position_embeddings"]


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, factor: float, s: dict) -> torch.Tensor:
    # YaRN: dimensions that rotate more than beta_fast times over the original context keep their
    # frequency (extrapolate), those under beta_slow are divided by `factor` (interpolate), with a
    # linear ramp between; `truncate` rounds the ramp's ends to whole dimensions
    old_len = s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate


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
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling, self.max_positions).to(self.cos_sin.device)
        freqs = torch.outer(torch.arange(self.max_positions, device=inv_freq.device).float(), inv_freq)
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        factor = rope_attention_factor(self.scaling, self.max_positions)
        self.cos_sin.copy_(table if factor == 1.0 else table * factor)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hkv, D]."""
        cos, sin = self.cos_sin[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)
