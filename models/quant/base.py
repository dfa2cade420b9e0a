"""The linear-method contract: a linear layer owns its shapes and sharding, its method owns the weights.

A layer (models/layers/linear.py) calls, in order:
- `create_weights(layer, ...)` once at build (on the meta device): register the parameters the
  method needs (weight; later also weight_scale, input_scale, ...), each tagged with how it is laid
  out so the layer's `weight_loader` can write one shard or one section into it;
- `process_weights_after_loading(layer)` once after every checkpoint tensor is in (repack, quantise,
  take the max of per-shard scales, ...);
- `apply(layer, x, bias)` in forward.

Parameter tags (set with `set_weight_attrs`):
- `output_dim` / `input_dim`: the dimension that is split across ranks and, for merged layers,
  holds the q/k/v or gate/up sections one after another (None: not split);
- `per_shard`: dim 0 has one entry per logical shard (a per-tensor FP8 scale for each of q, k, v),
  written at that shard's index instead of a slice, so scales load through the same shard ids as
  the weights they scale;
- `block` = (rows, cols): one value per weight block (block-FP8 scales), so the layer counts the
  `output_dim` / `input_dim` sizes in blocks.

A layer gets a method at build (unquantized) and may be given another before loading
(`LinearBase.set_linear_method`: the loader does so for quantised checkpoints, models/loader/quantize.py).
"""

from __future__ import annotations

import torch
from torch import nn


def set_weight_attrs(param: nn.Parameter, attrs: dict) -> None:
    for key, value in attrs.items():
        if hasattr(param, key):
            raise AttributeError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


class LinearMethod:
    """Subclasses implement create_weights and apply; process_weights_after_loading is optional."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader,
    ) -> None:
        """Register the layer's parameters. `output_partition_sizes` is this rank's size of each
        logical shard (one entry for a plain linear, [q, k, v] or [gate, up] for merged ones)."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        return None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError
