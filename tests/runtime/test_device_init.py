"""The CUDA context made on a thread during start-up (atomc/runtime/device_init.py), and the
compiler imports it overlaps (compat.import_compiler)."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from atomc import compat
from atomc.runtime.device_init import DeviceInit


def test_a_cpu_device_starts_no_thread():
    before = threading.active_count()
    init = DeviceInit("cpu")
    assert not init.started and threading.active_count() == before
    assert init.wait() == 0.0 and init.seconds == 0.0


def test_the_threads_error_is_raised_where_the_caller_waits(monkeypatch):
    def broken():
        raise RuntimeError("no CUDA driver here")

    monkeypatch.setattr(torch.cuda, "init", broken)
    init = DeviceInit("cuda")
    assert init.started
    with pytest.raises(RuntimeError, match="no CUDA driver here"):
        init.wait()


def test_the_context_is_made_off_the_callers_thread(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "init", lambda: seen.append(threading.current_thread().name))
    monkeypatch.setattr(torch, "empty", lambda *a, **k: seen.append("alloc"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: seen.append("sync"))
    init = DeviceInit("cuda:0")
    assert init.wait() >= 0.0
    assert seen == ["atomc-cuda-init", "alloc", "sync"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_real_context_is_ready_after_wait():
    init = DeviceInit("cuda")
    init.wait()
    assert torch.cuda.is_initialized() and init.seconds > 0


def test_import_compiler_imports_what_an_artifact_load_needs(monkeypatch):
    monkeypatch.setattr(compat, "COMPILER_MODULES", (*compat.COMPILER_MODULES, "torch._no_such_module_here"))
    compat.import_compiler(gpu=False)  # a name this torch lacks is skipped
    for name in compat.COMPILER_MODULES[:-1]:
        assert name in sys.modules, name
