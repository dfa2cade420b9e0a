"""Shared by the engine tests: prompts, a CPU engine on the tiny checkpoint, the pool check, and a
worker killed mid-generation."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from atomc import LLM, SamplingParams
from atomc.engine.parallel_executor import WorkerDied

PROMPTS = [
    "The capital of France is",
    "Once upon a time there was a small engine that compiled graphs and",
    "def add(a, b):\n",
    "Paged attention keeps keys and values in fixed-size blocks of memory. " * 3,
    "1 2 3",
]


def make(llama_dir, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    return LLM(model=str(llama_dir), device="cpu", enforce_eager=True, **kw)


def assert_pool_free(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def assert_killed_worker_ends_the_engine(llm: LLM, proc, match: str, max_tokens: int = 120, within_s: float = 15):
    """SIGKILL `proc` (one of the engine's worker processes) mid-generation: `generate` raises
    WorkerDied matching `match` within `within_s`, every worker is gone, and the engine stays ended."""
    long = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    killer = threading.Timer(0.5, os.kill, (proc.pid, signal.SIGKILL))
    killer.start()
    t0 = time.perf_counter()
    with pytest.raises(WorkerDied, match=match):
        for _ in range(50):  # generation is fast: keep stepping until the kill lands
            llm.generate(["hello"] * 4, long)
    assert time.perf_counter() - t0 < within_s
    killer.join()
    assert not any(p.is_alive() for p in llm.engine.executor.procs)
    with pytest.raises(WorkerDied):
        llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4))
