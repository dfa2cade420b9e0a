"""Programmatic dependent launch (PDL, Hopper and later): a kernel starts while the one before it
finishes, so the gap between two kernels of a decode step is not a drained memory pipeline.

At batch 1 a decode step is hundreds of short kernels (Qwen3-30B-A3B: ~700 a step, 4-5 µs each),
and each boundary costs the launch, the ramp-up of the next kernel's loads and the tail of the
last. With PDL the next kernel is launched when every program of the current one has started
(each passed `after_producer`), loads what does not depend on it (its weights: nothing in a step
writes them), and blocks in `after_producer` until the previous kernel has finished and its writes
are visible. CUDA graph capture keeps these programmatic edges.

The rules every kernel that takes `PDL` keeps (tests/kernels/test_pdl.py checks the first
and the last under the interpreter; test_pdl_gpu.py runs them with PDL on):
- every program calls `after_producer(PDL)` once, before its first read of an activation, the KV
  cache or anything else a kernel of the step writes, and before its first store or atomic; a
  program that exits early calls it first too (the kernel after it trusts that this one finishing means everything
  before it finished);
- it is launched with `**launch(x)`, which sets the constexpr and the launch flag together: a
  kernel launched early that never waits would read stale data;
- before the wait it loads only model weights.

On anything but a CUDA device of compute capability 9.0 or more (CPU tensors under the Triton
interpreter, ROCm, Ampere), or when the engine's `compile.enable_pdl` is off, `launch` gives
PDL=False and the kernels compile to what they were without it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4 (the device's 3.6 and the CPU wheels have it)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - an older Triton: PDL stays off
    gdc_launch_dependents = gdc_wait = None

_enabled = True


def configure(enabled: bool) -> None:
    """The engine's `compile.enable_pdl` (set once per process by the model runner)."""
    global _enabled
    _enabled = bool(enabled)


def enabled() -> bool:
    return _enabled


@functools.cache
def _supported(index: int) -> bool:
    if gdc_wait is None or torch.version.hip:
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def active(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with PDL."""
    return _enabled and t.is_cuda and _supported(t.device.index or 0)


def launch(t: torch.Tensor) -> dict:
    """The launch keywords of a PDL-aware kernel whose tensors live on t's device: the `PDL`
    constexpr, and the launch flag only where it is on."""
    return {"PDL": True, "launch_pdl": True} if active(t) else {"PDL": False}


@triton.jit
def after_producer(PDL: tl.constexpr):
    """Block until the kernel before this one has finished and its writes are visible, then let
    the next kernel launch (it does once every program of this one has passed here or exited)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
