"""Every GEMM -> atomc::linear on CUDA, whose triton backend runs the reduce GEMV for one-row inputs.

Pattern:      y = F.linear(x, w, b)
Replacement:  y = atomc.linear(x, w, b)
At batch 1 the decode step is its weight reads, and there the GEMV beat cuBLAS on every shape of the
8B models on the H200 (docs/performance.md); for more rows the backend calls F.linear itself. Other
platforms keep F.linear (no measured win there: the ROCm vendor GEMMs are untouched).
"""

from __future__ import annotations

import torch

from atomc.passes import match
from atomc.passes.base import FusionPass

LINEAR = torch.ops.atomc.linear.default
PLATFORMS = ("cuda",)


class DecodeGemv(FusionPass):
    name = "decode_gemv"
    anchor = "linear"  # every spelling of F.linear

    def __init__(self, platform: str = "cpu"):
        self.platform = platform

    def rewrite(self, gm, node) -> bool:
        if self.platform not in PLATFORMS:
            return False
        x, weight = match.arg(node, 0, "input"), match.arg(node, 1, "weight")
        bias = match.arg(node, 2, "bias")
        node.target, node.args, node.kwargs = LINEAR, (x, weight, bias), {}
        return True

    def notes(self) -> str:
        return "" if self.platform in PLATFORMS else f"F.linear kept on {self.platform}"
