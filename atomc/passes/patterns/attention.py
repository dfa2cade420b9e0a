"""Attention: models already call the opaque atomc::attention (it owns the KV cache), so this only
counts it; fuse_rope_kv_write splits it later. A model calling SDPA directly would be matched here."""

from __future__ import annotations

import torch

from atomc.passes import match
from atomc.passes.patterns.base import Pattern

ATTENTION = (torch.ops.atomc.attention, torch.ops.atomc.attention.default)


class AttentionPattern(Pattern):
    name = "attention"

    def apply(self, gm):
        return len(match.calls(gm, ATTENTION)), 0
