"""Shared by the engine tests: prompts, a CPU engine on the tiny checkpoint, and the pool check."""

from __future__ import annotations

from atomc import LLM

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
