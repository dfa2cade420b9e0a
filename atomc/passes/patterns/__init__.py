"""The canonicalisation patterns, applied in this order by the canonicalize pass.

The patterns are independent of each other (each matches plain torch ops, none reads another's
output), so the order only fixes how reports read.

Hand matching is for small elementwise idioms only. The big blocks come out of the model as atomc
ops already (attention today; MoE, MLA and quantised linears when they arrive): a model calls
`torch.ops.atomc.<op>` itself, so no pattern has to recognise a router loop or a latent attention
in Dynamo's torch-level graph, where every spelling of a block would cost matching code.
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
]

__all__ = ["PATTERNS", "NodePattern", "Pattern"]
