"""Dense weights in the model dtype; apply is one F.linear.

It must stay exactly `F.linear(x, weight, bias)`: the passes (canonicalize's linear pattern,
decode_gemv) and the lowering match that call in the traced graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.quant.base import LinearMethod, set_weight_attrs


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader):
        weight = nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            requires_grad=False,
        )
        set_weight_attrs(weight, {"output_dim": 0, "input_dim": 1, "weight_loader": weight_loader})
        layer.register_parameter("weight", weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)
