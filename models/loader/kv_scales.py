"""The per-layer FP8 KV-cache scales a checkpoint may ship, read beside its weights.

A quantised checkpoint can carry one k and one v scale per attention layer (the cache stores
k / k_scale, v / v_scale: vLLM's semantics), under any of the names its writers use:

- `<attn>.k_scale`, `<attn>.v_scale` (HF / vLLM fp8, compressed-tensors with a `kv_cache_scheme`);
- `<attn>.attn.k_scale`, `<attn>.attn.v_scale`, `<attn>.mla_attn.k_scale` (checkpoints saved from
  vLLM's module tree);
- `<attn>.k_proj.output_scale`, `<attn>.v_proj.output_scale` (older compressed-tensors, Quark);
- `<attn>.kv_scale` (the older single scale, for both).

An MLA layer (DeepSeek) uses its k scale (or kv_scale) for its whole latent row; a v_scale it
ships is read and not used (atomc/runtime/fp8_kv.py).

They are not parameters (no layer computes with them; the runner hands them to the attention
kernels through the forward context), so they are collected into `model.kv_cache_scales`:
{layer_idx: {"k": float, "v": float}}, the layer found through the attention module the name's
prefix maps to (the family's naming, so renamed or re-prefixed layers resolve too). They are used
with `--kv-cache-dtype fp8` only; a layer without them gets 1.0 (docs/quantization.md).
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

_PATTERNS = (
    re.compile(r"^(?P<attn>.+)\.(?P<which>[kv])_scale$"),
    re.compile(r"^(?P<attn>.+)\.(?P<which>[kv])_proj\.output_scale$"),
    re.compile(r"^(?P<attn>.+)\.(?P<which>kv)_scale$"),
)


def kv_scale_target(name: str) -> tuple[list[str], str] | None:
    """(the checkpoint prefixes that may be the attention module, "k" | "v" | "kv") when `name` is a
    KV-cache scale: the name's parent, then (vLLM's `<attn>.attn.k_scale`, `<attn>.mla_attn.k_scale`)
    its grandparent."""
    for pattern in _PATTERNS:
        hit = pattern.match(name)
        if hit is not None:
            attn = hit["attn"]
            parent = [attn.rsplit(".", 1)[0]] if attn.endswith((".attn", ".mla_attn")) else []
            return [attn, *parent], hit["which"]
    return None


def record_kv_scale(model: nn.Module, attn_param_prefix: str, which: str, name: str, value: torch.Tensor) -> bool:
    """Store one checkpoint KV scale in `model.kv_cache_scales`; False when `attn_param_prefix`
    names no attention layer of the model (the caller reports the tensor as unexpected)."""
    try:
        module = model.get_submodule(attn_param_prefix)
    except AttributeError:
        return False
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        return False
    if value.numel() != 1:
        raise ValueError(
            f"{name} has shape {tuple(value.shape)}: only per-tensor KV-cache scales (one k and one v per layer) "
            "are supported"
        )
    scale = float(value.float().reshape(()))
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{name} is {scale}: a KV-cache scale must be positive and finite")
    entry = model.kv_cache_scales.setdefault(layer, {})
    for key in ("k", "v") if which == "kv" else (which,):
        entry[key] = scale
    return True
