"""Building blocks in plain torch. The compiler's passes find these patterns and rewrite them into
fused kernels, so they stay written the way a reader (and the pattern matcher) expects."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class SiluAndMulMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.inter = inter

    def merge_gate_up(self) -> bool:
        """After loading: one GEMM for gate and up (their weights concatenated). Returns False if already merged."""
        if hasattr(self, "gate_up_proj"):
            return False
        self.gate_up_proj = merge_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def merge_linears(linears: list[nn.Linear]) -> nn.Linear:
    """One nn.Linear whose output is the concatenation of `linears`' outputs (same input)."""
    first = linears[0]
    has_bias = first.bias is not None
    # built on the meta device: a real nn.Linear would first run its random init on the CPU, which
    # for an 8B model's 32 gate_up projections alone takes tens of seconds at every start
    out = nn.Linear(first.in_features, sum(m.out_features for m in linears), bias=has_bias, device="meta")
    grad = first.weight.requires_grad
    with torch.no_grad():
        out.weight = nn.Parameter(torch.cat([m.weight for m in linears], dim=0), requires_grad=grad)
        if has_bias:
            out.bias = nn.Parameter(torch.cat([m.bias for m in linears], dim=0), requires_grad=grad)
    return out


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope scaling {kind!r} is not supported (supported: default, linear, llama3)")


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
