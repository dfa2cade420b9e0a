"""`atomc::mla_latent_norm_rope`: what an MLA layer does to its latent before attending, as one op.

DeepSeek's `kv_a_proj_with_mqa` gives, per token, the latent c_kv and one rope key k_pe shared by
the heads. Before `atomc::mla_attention` the layer RMS-normalises c_kv (`kv_a_layernorm`) and rotates
k_pe with the query's rope part q_pe; checkpoints that pair rope dims as (0, 1), (2, 3), ... (V2,
V3's `rope_interleave`) first gather the evens then the odds of both (rotate-half's pairing). The
pass `fuse_mla_latent_norm_rope` folds those three small steps and the gather into this op, so a
backend reads each input once in one launch instead of four or more (the norm, two gathers, RoPE).

The op is functional (new tensors out, nothing written), so it needs no ordering against the cache
write of `atomc::mla_attention`, which takes its outputs. The inputs may be strided views (the split
of the projection, the rope slice of q): the op reads them where they lie, no copy first. The
reference repeats the model's ops (atomc::rms_norm's and atomc::rope's references), so on the torch
backend the fused graph gives the unfused graph's numbers exactly.
"""

from __future__ import annotations

import torch

from atomc.ops.norm import rms_norm_reference
from atomc.ops.rope import rope_reference


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rope dims paired (0, 1), (2, 3), ... -> the evens then the odds (rotate-half's pairing)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def mla_latent_norm_rope_reference(positions, q_pe, k_pe, c_kv, weight, eps, cos_sin_cache, interleaved):
    if interleaved:
        q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
    q_rot, k_rot = rope_reference(positions, q_pe, k_pe, cos_sin_cache)
    # contiguous, as the fake promises (a strided input could give a strided product)
    return q_rot.contiguous(), k_rot.contiguous(), rms_norm_reference(c_kv, weight, eps).contiguous()


@torch.library.custom_op("atomc::mla_latent_norm_rope", mutates_args=())
def mla_latent_norm_rope(
    positions: torch.Tensor,
    q_pe: torch.Tensor,
    k_pe: torch.Tensor,
    c_kv: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """positions [T]; q_pe [T, H, R]; k_pe [T, 1, R] (one key for every head); c_kv [T, L]; weight [L];
    cos_sin_cache [max_pos, R] (cos half | sin half); `interleaved`: de-interleave q_pe and k_pe first.
    -> (rotated q_pe [T, H, R], rotated k_pe [T, 1, R], rms_norm(c_kv) [T, L]), contiguous."""
    return mla_latent_norm_rope_reference(positions, q_pe, k_pe, c_kv, weight, eps, cos_sin_cache, interleaved)


@mla_latent_norm_rope.register_fake
def _(positions, q_pe, k_pe, c_kv, weight, eps, cos_sin_cache, interleaved):
    normed = c_kv.new_empty(c_kv.shape, dtype=torch.promote_types(c_kv.dtype, weight.dtype))
    return q_pe.new_empty(q_pe.shape), k_pe.new_empty(k_pe.shape), normed
