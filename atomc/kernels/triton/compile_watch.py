"""Triton compiles after start-up, each logged as a warning.

A kernel variant first used in the middle of serving compiles there (seconds when Triton's disk
cache lacks it) while every request in flight waits. The start-up forwards exist to reach every
variant a step can pick (runtime/capture_sizes.warm_up_sizes, kernels/triton/specialize.py); a line
from here names one they missed, and benchmarks/serving.py counts them per cell. The hooks see
`@triton.jit` kernels launched through the JIT (atomc's); Inductor's generated kernels compile through
its own runtime and are not watched.
"""

from __future__ import annotations

import logging
import threading
import time

from atomc import compat

log = logging.getLogger(__name__)

MARK = "Triton compiled a kernel variant while serving"

_lock = threading.Lock()
_started: dict[int, float] = {}  # thread id -> when its compile began (a thread compiles one at a time)
_count = 0
_installed = False


def late_compiles() -> int:
    """Variants compiled since `start()` in this process."""
    return _count


def start() -> bool:
    """Log every Triton compile from now on in this process (once; later calls do nothing). Returns
    whether the hooks are in (False without Triton's hooks: an older Triton, or none)."""
    global _installed
    hooks = compat.triton_jit_hooks()
    if hooks is None:
        return False
    with _lock:
        if _installed:
            return True
        hooks.jit_cache_hook = _chain(hooks.jit_cache_hook, _before)
        hooks.jit_post_compile_hook = _chain(hooks.jit_post_compile_hook, _after)
        _installed = True
    return True


def _chain(earlier, ours):
    """Ours, then a hook installed before it (whose answer the JIT reads: a true one skips the compile)."""

    def hook(**kwargs):
        try:
            ours(**kwargs)
        except Exception:  # a diagnostic never fails a step
            log.debug("compile watch hook failed", exc_info=True)
        return earlier(**kwargs) if earlier is not None else None

    return hook


def _before(**kwargs) -> None:
    if not kwargs.get("is_manual_warmup"):
        _started[threading.get_ident()] = time.perf_counter()


def _after(**kwargs) -> None:
    global _count
    t0 = _started.pop(threading.get_ident(), None)
    if t0 is None:
        return  # a manual warm-up (kernel.warmup), asked for
    fn = kwargs.get("fn")
    name = f"{fn.module}.{fn.name}" if fn is not None else "?"
    with _lock:
        _count += 1
    log.warning(
        "%s: %s in %.2f s (the start-up forwards did not reach this variant; every request in flight waited): %s",
        MARK, name, time.perf_counter() - t0, kwargs.get("repr", ""),
    )  # fmt: skip
