"""Inputs of atomc::mla_latent_norm_rope laid out as DeepSeek's MLA layer produces them, shared by the
interpreter and GPU kernel tests."""

from __future__ import annotations

import torch


def cos_sin_cache(max_pos: int, d: int, device) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


def layer_inputs(tokens, heads, lora, rope, dtype, device, interleaved, nope=16, seed=0):
    """(positions, q_pe, k_pe, c_kv, weight, eps, cos_sin_cache, interleaved): q_pe [T, H, R] a slice
    of q [T, H, nope + R]; c_kv [T, L] and k_pe [T, 1, R] the parts of one [T, L + R] projection."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, nope + rope, generator=g).to(dtype).to(device)
    kv = torch.randn(tokens, lora + rope, generator=g).to(dtype).to(device)
    c_kv, k_pe = kv.split([lora, rope], dim=-1)
    weight = (1 + 0.5 * torch.randn(lora, generator=g)).to(dtype).to(device)
    positions = torch.randint(0, 64, (tokens,), generator=g).to(device)
    cos_sin = cos_sin_cache(64, rope, device)
    return positions, q[..., nope:], k_pe.reshape(tokens, 1, rope), c_kv, weight, 1e-6, cos_sin, interleaved
