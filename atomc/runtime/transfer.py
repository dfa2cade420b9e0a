"""Host -> device copies that do not wait for the GPU.

`torch.tensor(values, device="cuda")` copies from pageable memory and then synchronizes the stream,
so every such call waits for all the kernels queued before it: with the next step launched while the
previous one still runs (async scheduling), one of them undoes the overlap. Staging through pinned
memory makes the copy asynchronous; torch's pinned-memory cache keeps the buffer alive until the copy
has run, so nothing here needs an event.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`values` (a list, or a CPU tensor) as a tensor on `device`, queued without a sync."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def to_host_async(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t`, queued behind the kernels that produce it: valid once the stream has
    passed this point (record an event after it and wait on that before reading)."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
