"""The gated MLP: down(silu(gate(x)) * up(x)), gate and up as one GEMM (MergedColumnParallelLinear).

The forward is written as split + silu * mul because the canonicalize pass matches that (silu_mul)
and fuse_silu_mul then folds the split into atomc::silu_and_mul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from models.layers.parallel import SINGLE, ParallelInfo


class GatedMLP(nn.Module):
    def __init__(
        self, hidden: int, inter: int, bias: bool, parallel: ParallelInfo = SINGLE, linear_method=None,
        reduce_results: bool = True,
    ):  # fmt: skip
        """reduce_results=False: the output is this rank's partial sum (see RowParallelLinear)."""
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias, parallel, linear_method)
        self.down_proj = RowParallelLinear(inter, hidden, bias, parallel, linear_method, reduce_results)
        self.inter = self.gate_up_proj.local_output_sizes[0]  # this rank's gate (= up) width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(gate) * up)
