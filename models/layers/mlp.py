"""The gated MLP: down(silu(gate(x)) * up(x)), gate and up as one GEMM (MergedColumnParallelLinear).

The forward is written as split + silu * mul because the canonicalize pass matches that (silu_mul)
and fuse_silu_mul then folds the split into atomc::silu_and_mul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from models.layers.parallel import SINGLE, ParallelInfo, all_reduce


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool, parallel: ParallelInfo = SINGLE, linear_method=None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias, parallel, linear_method)
        self.down_proj = RowParallelLinear(inter, hidden, bias, parallel, linear_method)
        self.inter = self.gate_up_proj.local_output_sizes[0]  # this rank's gate (= up) width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.down_proj.parallel, self.partial_forward(x))

    def partial_forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the output, before down_proj's all-reduce (for a caller that
        adds another partial sum over the same ranks and reduces once)."""
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj.partial_forward(F.silu(gate) * up)
