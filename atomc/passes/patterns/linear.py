"""Linear: one spelling for every GEMM (F.linear). No custom op on purpose: GEMMs stay visible to
Inductor (cuBLAS/hipBLASLt choice, bias epilogues); lowering may still swap them per backend later."""

from __future__ import annotations

import torch

from atomc.passes import match
from atomc.passes.patterns.base import Pattern

CANONICAL = torch.nn.functional.linear


class LinearPattern(Pattern):
    name = "linear"

    def apply(self, gm):
        matched = rewritten = 0
        for node in gm.graph.nodes:
            if match.is_op(node, "linear"):
                matched += 1
                if node.target is not CANONICAL:
                    node.target = CANONICAL
                    rewritten += 1
        return matched, rewritten
