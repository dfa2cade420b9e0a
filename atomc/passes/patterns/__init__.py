"""The registry of canonicalisation patterns, applied in this order by the canonicalize pass.

The patterns are independent of each other (each matches plain torch ops, none reads another's
output), so the order only fixes how reports read.
"""

from __future__ import annotations

from atomc.passes.patterns.attention import AttentionPattern
from atomc.passes.patterns.base import NodePattern, Pattern
from atomc.passes.patterns.linear import LinearPattern
from atomc.passes.patterns.rms_norm import RMSNormPattern
from atomc.passes.patterns.rope import RopePattern
from atomc.passes.patterns.silu_mul import SiluMulPattern

PATTERNS: list[Pattern] = [
    LinearPattern(),
    RMSNormPattern(),
    SiluMulPattern(),
    RopePattern(),
    AttentionPattern(),
    # ---- reserved: MoE and MLA patterns (added with the MoE / MLA models) ----
    # MoE: router (softmax or sigmoid, topk, renormalise) + the per-expert loop
    #      -> atomc::moe_router + atomc::fused_moe (weights stacked at load by the MoE layer's weight_loader).
    # MLA: compressed q/kv projections, the rope/nope split and latent attention
    #      -> atomc::mla_attention (absorbed form for decode).
    # Register them with `register(...)` from the model's module, or list them here.
]


def register(pattern: Pattern, before: str | None = None) -> None:
    """Add a pattern (e.g. MoE/MLA); `before` names an existing pattern it must precede.
    Patterns are part of canonicalize's source hash only if listed in this file; a pattern defined
    elsewhere must bump Canonicalize.version or its file won't reach the compile cache key."""
    names = [p.name for p in PATTERNS]
    if pattern.name in names:
        raise ValueError(f"pattern {pattern.name!r} is already registered")
    PATTERNS.insert(names.index(before) if before else len(PATTERNS), pattern)


__all__ = ["PATTERNS", "NodePattern", "Pattern", "register"]
