"""The greedy token of each logits row: the Triton two-stage argmax where the kernel registry would
run Triton (CUDA, ROCm), torch.argmax elsewhere. Same result either way, bit for bit."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from atomc.kernels.registry import PLATFORM_BACKENDS, backend_available
from atomc.platforms import platform_of


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


@functools.cache
def row_argmax(device_type: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The row argmax for a device type; a CPU process never imports triton here."""
    platform = platform_of(device_type)
    if "triton" in PLATFORM_BACKENDS[platform] and backend_available("triton"):
        from atomc.kernels.triton.argmax import argmax_rows

        return argmax_rows
    return _torch_argmax


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, V] -> int64 [rows], as logits.argmax(dim=-1) (first index of the maximum, NaN
    above every number). Queues kernels only; never waits for the device."""
    return row_argmax(logits.device.type)(logits)


def warm_greedy(logits: torch.Tensor) -> None:
    """Compile the argmax for what the sampler hands it, one row of each: the raw logits (plain
    greedy) and their fp32 copy (greedy rows after logit edits), so no served step waits for it."""
    row = logits[:1]
    for x in (row, row.float()):
        greedy_tokens(x)
