"""AsyncEngine.call: work run on the engine thread (what /tokenize and /detokenize use), with a
stub engine so no model loads: the result comes back, a ValueError reaches the caller, and a dead
engine answers EngineDeadError instead of leaving the caller waiting."""

from __future__ import annotations

import asyncio
import threading

import pytest

from atomc.serve.async_engine import AsyncEngine, EngineDeadError


class StubEngine:
    alive = True

    def stats(self) -> dict:
        return {}

    def has_unfinished_requests(self) -> bool:
        return False

    def close(self) -> None:
        pass


def run(coro):
    return asyncio.run(coro)


def test_call_runs_on_the_engine_thread_and_returns():
    async def main():
        aengine = AsyncEngine(StubEngine())
        aengine.start()
        try:
            name = await aengine.call(lambda: threading.current_thread().name)
            total = await aengine.call(sum, [1, 2, 3])
        finally:
            await aengine.shutdown()
        return name, total

    assert run(main()) == ("atomc-engine", 6)


def test_call_raises_the_functions_error():
    def bad():
        raise ValueError("prompt: not this")

    async def main():
        aengine = AsyncEngine(StubEngine())
        aengine.start()
        try:
            with pytest.raises(ValueError, match="not this"):
                await aengine.call(bad)
            assert await aengine.call(lambda: 1) == 1  # the thread keeps serving
        finally:
            await aengine.shutdown()

    run(main())


def test_call_on_a_stopped_engine_fails_at_once():
    async def main():
        aengine = AsyncEngine(StubEngine())
        aengine.start()
        await aengine.shutdown()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(aengine.call(lambda: 1), 5)

    run(main())
