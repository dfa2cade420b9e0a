"""The late-compile log (atomc/kernels/triton/compile_watch.py), through stand-in hooks: the JIT's
real ones fire only where kernels compile for a GPU."""

import logging
import types

import pytest

from atomc.kernels.triton import compile_watch


@pytest.fixture
def hooks(monkeypatch):
    calls = []

    def earlier(**kwargs):
        calls.append(kwargs["repr"])
        return "skip" if kwargs["repr"] == "cached elsewhere" else None

    runtime = types.SimpleNamespace(jit_cache_hook=earlier, jit_post_compile_hook=None)
    monkeypatch.setattr(compile_watch.compat, "triton_jit_hooks", lambda: runtime)
    monkeypatch.setattr(compile_watch, "_installed", False)
    monkeypatch.setattr(compile_watch, "_count", 0)
    return runtime, calls


def compile_variant(runtime, repr_, manual=False):
    fn = types.SimpleNamespace(module="atomc.kernels.triton.rope", name="_rope_kernel")
    kwargs = dict(key="k", repr=repr_, fn=fn, compile={}, is_manual_warmup=manual, already_compiled=False)
    answer = runtime.jit_cache_hook(**kwargs)
    runtime.jit_post_compile_hook(**kwargs)
    return answer


def test_each_compile_after_start_is_a_warning_and_counted(hooks, caplog):
    runtime, calls = hooks
    assert compile_watch.start() and compile_watch.start()  # a second start adds no second hook
    with caplog.at_level(logging.WARNING, logger=compile_watch.__name__):
        compile_variant(runtime, "_rope_kernel[num_warps=4](num_slots: i32)")
        compile_variant(runtime, "a warm-up the caller asked for", manual=True)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(compile_watch.MARK)
    assert "atomc.kernels.triton.rope._rope_kernel" in lines[0] and "num_slots: i32" in lines[0]
    assert compile_watch.late_compiles() == 1
    # the hook installed before ours still runs, once a compile, and its answer reaches the JIT
    assert calls == ["_rope_kernel[num_warps=4](num_slots: i32)", "a warm-up the caller asked for"]
    assert compile_variant(runtime, "cached elsewhere") == "skip"


def test_without_the_hooks_nothing_is_installed(monkeypatch):
    monkeypatch.setattr(compile_watch.compat, "triton_jit_hooks", lambda: None)
    monkeypatch.setattr(compile_watch, "_installed", False)
    assert compile_watch.start() is False


def test_the_installed_triton_has_the_hooks():
    pytest.importorskip("triton")
    runtime = compile_watch.compat.triton_jit_hooks()
    assert runtime is not None and hasattr(runtime, "jit_post_compile_hook")
