"""Counting the tensor copies a computation makes outside its Triton kernels, on the CPU.

A contiguous same-dtype copy (`clone`, `contiguous`, `copy_`) between kernels is a device-to-device
memcpy inside a CUDA graph (`memcpy32_post` in an H200 profile of a decode step). On the CPU the
torch profiler sees each as an `aten::copy_` (or a scatter) event. The Triton interpreter copies
every tensor argument to the host and back around each launch; those copies do not exist on a GPU,
so launches are wrapped in a named profiler range and copies under it are not counted.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile, record_function

COPY_OPS = frozenset(
    ("aten::copy_", "aten::index_put_", "aten::index_copy_", "aten::slice_scatter", "aten::as_strided_scatter")
)
_LAUNCH = "triton interpreter launch"


@contextlib.contextmanager
def _named_launches():
    from triton.runtime.interpreter import GridExecutor

    original = GridExecutor.__call__

    def launch(self, *args, **kwargs):
        with record_function(_LAUNCH):
            return original(self, *args, **kwargs)

    GridExecutor.__call__ = launch
    try:
        yield
    finally:
        GridExecutor.__call__ = original


def _in_launch(event) -> bool:
    while event is not None:
        if event.name == _LAUNCH:
            return True
        event = event.cpu_parent
    return False


def copies_outside_kernels(fn: Callable[[], object]) -> collections.Counter:
    """Run `fn()` once; the copies it made outside Triton launches, as (op, input shapes) -> count."""
    with _named_launches(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with torch.no_grad():
            fn()
    return collections.Counter(
        (e.name, str(e.input_shapes)) for e in prof.events() if e.name in COPY_OPS and not _in_launch(e)
    )
