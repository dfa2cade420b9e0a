"""The engine on its own thread, so the HTTP event loop never waits on compute.

The engine is any `EngineClient` (atomc/engine/client.py): an in-process `LLMEngine`, or an
`EngineProcessClient` (engine/process.py), whose `step()` waits for the engine process's next step
instead of computing it.

`LLMEngine` is synchronous and not thread-safe, so one background thread owns it: it drains a
command queue (add / abort / stop), runs `step()` while there is work, and posts each
`RequestOutput` to the asyncio side with `loop.call_soon_threadsafe`. Outputs are cumulative, so
an `OutputStream` keeps only the latest one per request: a slow reader costs no memory and sees
the same text, just in larger deltas.

One `OutputStream` carries every engine request of one HTTP request (several prompts), so the
HTTP side waits on one event instead of merging iterators. A step that failed only its own requests
(`RequestOutput.error`, see LLMEngine.step) fails those streams with `RequestFailedError` and the
loop goes on. If `step()` raises (the engine gave up), every in-flight stream fails with
`EngineDeadError`, the thread exits, health turns 503, later submissions fail at once, and
`on_dead` runs (the server exits non-zero on it, so a supervisor restarts it). The thread's exit
path fails every stream it holds, and a request still being added
re-checks the thread now and then, so no client hangs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from atomc.engine.client import EngineClient
from atomc.outputs import RequestOutput
from atomc.sampling_params import SamplingParams

logger = logging.getLogger("atomc.serve")

# how long an idle engine thread blocks on its queue before re-checking its state
_IDLE_WAIT_S = 0.5
# how often a request waiting to be added re-checks that the engine thread is still alive
_READER_WAKE_S = 1.0


@dataclass
class ChatPrompt:
    """A prompt still to be rendered with the chat template, on the engine thread (one round trip)."""

    messages: list[dict]
    chat_template: str | None = None
    tools: list[dict] | None = None
    template_kwargs: dict | None = None  # the request's chat_template_kwargs (enable_thinking, ...)


class EngineDeadError(RuntimeError):
    """The engine thread failed or stopped; requests get 500 / 503 instead of hanging."""


class ShuttingDownError(EngineDeadError):
    """The drain time ran out with this request still running: 503, or an SSE error event in a stream."""


class RequestFailedError(RuntimeError):
    """The engine failed this request (a step it was in raised) but keeps serving others: a 500."""


class OutputStream:
    """Outputs of the engine requests behind one HTTP request, read on the event loop.

    The engine thread calls `_post_*` through `call_soon_threadsafe`; the loop side reads with
    `async for index, output in stream`, where `index` is the position in the submitted batch.
    Iteration ends when every request finished.
    """

    def __init__(self, request_ids: Sequence[str], loop: asyncio.AbstractEventLoop, owner: AsyncEngine):
        self.request_ids = list(request_ids)
        self._index = {rid: i for i, rid in enumerate(self.request_ids)}
        self._loop = loop
        self._owner = owner
        self._pending: dict[int, RequestOutput] = {}
        self._unfinished = set(range(len(self.request_ids)))
        self._event = asyncio.Event()
        self._error: BaseException | None = None
        self._added: asyncio.Future = loop.create_future()
        # a reader that went away never looks at a failed add; mark it seen so asyncio does not warn
        self._added.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.arrival_time = time.perf_counter()

    # ---- engine-thread side: hop onto the loop; a closed loop means nobody is listening ----
    def _deliver(self, fn: Callable, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass

    # ---- loop side ----
    def _post_added(self, error: BaseException | None) -> None:
        if self._added.done():
            return
        if error is None:
            self._added.set_result(None)
        else:
            self._unfinished.clear()
            self._added.set_exception(error)

    def _post_output(self, out: RequestOutput) -> None:
        i = self._index.get(out.request_id)
        if i is None or i not in self._unfinished:
            return  # aborted by its reader, or already finished
        self._pending[i] = out  # cumulative: the newest one replaces an unread older one
        self._event.set()

    def _post_error(self, error: BaseException) -> None:
        self._post_added(error)
        if self._error is None:
            self._error = error
        self._event.set()

    @property
    def finished(self) -> bool:
        return not self._unfinished and not self._pending

    def abort(self) -> None:
        """Abort every unfinished request of this stream (frees their KV blocks); idempotent."""
        for i in sorted(self._unfinished):
            self._owner.abort(self.request_ids[i])
        self._unfinished.clear()

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self._unfinished or self._pending:
            if not self._pending:
                if self._error is not None:
                    raise self._error
                # no timeout needed (and none paid per token): once added, a stream is failed by the
                # engine thread's own exit path, whatever ends the thread
                await self._event.wait()
                self._event.clear()
            batch, self._pending = self._pending, {}
            for i, out in sorted(batch.items()):
                if out.finished:
                    self._unfinished.discard(i)
                if out.error is not None:
                    self.abort()  # the other prompts of this HTTP request fail with it
                    raise RequestFailedError("the engine failed while running this request")
                yield i, out


class AsyncEngine:
    """Thread-safe, asyncio-facing wrapper around a synchronous `EngineClient`."""

    def __init__(self, engine: EngineClient, on_dead: Callable[[], None] | None = None):
        self.engine = engine
        self.on_dead = on_dead  # called once from the engine thread when the engine failed for good
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, OutputStream] = {}  # engine-thread only
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stopping = False
        self._stats: dict = {}

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stats = dict(self.engine.stats())
        self._thread = threading.Thread(target=self._run, name="atomc-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        t = self._thread
        # an engine process can die while idle
        return t is not None and t.is_alive() and self.engine.alive and self._error is None and not self._stopping

    @property
    def error(self) -> BaseException | None:
        return self._error

    def check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError("the engine failed; see the server log")
        if self._thread is None or not self._thread.is_alive():
            raise EngineDeadError("engine is not running")
        if not self.engine.alive:
            raise EngineDeadError("the engine process is not running")

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort whatever is still running, stop the thread and wait for it (bounded)."""
        self._stopping = True
        self._commands.put(("stop",))
        t = self._thread
        if t is not None and t.is_alive():
            await asyncio.get_running_loop().run_in_executor(None, t.join, timeout)

    def stats(self) -> dict:
        """Latest engine stats, refreshed by the engine thread after every step (no waiting)."""
        return self._stats

    # ------------------------------------------------------------------ requests
    async def submit(
        self, requests: Sequence[tuple[str, str | list[int] | ChatPrompt, SamplingParams]]
    ) -> OutputStream:
        """Add a batch of requests; raises the engine's ValueError (bad prompt) before anything streams.

        All or nothing: when one prompt is rejected, the ones already added are aborted.
        """
        if self._stopping:
            raise EngineDeadError("server is shutting down")
        self.check_alive()
        stream = OutputStream([r[0] for r in requests], asyncio.get_running_loop(), self)
        self._commands.put(("add", stream, list(requests), time.perf_counter()))
        try:
            while True:  # wake now and then so a dead engine thread cannot strand us
                try:
                    await asyncio.wait_for(asyncio.shield(stream._added), _READER_WAKE_S)
                    break
                except TimeoutError:
                    self.check_alive()
        except asyncio.CancelledError:
            stream.abort()
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the engine thread, between steps (the tokenizer and the chat template are
        used from that thread only: transformers' tokenizers are not safe to share across threads);
        its exception, a ValueError for a bad input, is raised here."""
        if self._stopping:
            raise EngineDeadError("server is shutting down")
        self.check_alive()
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        done.add_done_callback(lambda f: f.cancelled() or f.exception())  # a caller that left never reads it
        self._commands.put(("call", fn, args, done, loop))
        while True:  # wake now and then so a dead engine thread cannot strand us
            try:
                return await asyncio.wait_for(asyncio.shield(done), _READER_WAKE_S)
            except TimeoutError:
                self.check_alive()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                if not getattr(engine, "alive", True):  # an engine process that died while idle
                    raise RuntimeError("the engine process exited")
                busy = engine.has_unfinished_requests()
                if not self._drain_commands(block=not busy):
                    break
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    # stats first: a reader woken by an output then never sees older stats than it
                    self._stats = dict(engine.stats())
                    self._dispatch(outputs)
        except BaseException as e:  # anything escaping here means the engine is unusable: fail loudly
            self._fail_all(e)
        finally:
            self._shutdown_engine()

    def _drain_commands(self, block: bool) -> bool:
        """Run queued commands; block for the first one when idle. False on a stop command."""
        try:
            cmd = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd[0] == "stop":
                return False
            self._execute(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _execute(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "abort":
            if self._streams.pop(cmd[1], None) is not None:
                self.engine.abort_request(cmd[1])
                self._stats = dict(self.engine.stats())
        elif kind == "add":
            self._add(*cmd[1:])
        elif kind == "call":
            _, fn, args, done, loop = cmd
            try:
                result, error = fn(*args), None
            except Exception as e:  # the caller's to handle (a bad input is its 400)
                result, error = None, e
            _call_soon(loop, _settle, done, result, error)

    def _add(self, stream: OutputStream, requests: list, arrival: float) -> None:
        added: list[str] = []
        try:
            for rid, prompt, params in requests:
                if rid in self._streams:
                    raise ValueError(f"duplicate request id {rid!r}")
                if isinstance(prompt, ChatPrompt):
                    # the template already wrote BOS and friends: do not add them twice (vLLM's default)
                    text = self._render_chat(prompt)
                    self.engine.add_request(rid, text, params, arrival_time=arrival, add_special_tokens=False)
                else:
                    self.engine.add_request(rid, prompt, params, arrival_time=arrival)
                added.append(rid)
                self._streams[rid] = stream
        except Exception as e:  # ValueError = bad input (400); anything else is the engine's bug (500)
            for rid in added:
                self._streams.pop(rid, None)
                self.engine.abort_request(rid)
            stream._deliver(stream._post_added, e)
            return
        stream._deliver(stream._post_added, None)

    def _render_chat(self, chat: ChatPrompt) -> str:
        try:
            # tools and template variables only when the request has them, so an EngineClient
            # with the plain (messages, chat_template) signature serves every other request
            extra = dict(chat.template_kwargs or {})
            if chat.tools:
                extra["tools"] = chat.tools
            return self.engine.apply_chat_template(chat.messages, chat.chat_template, **extra)
        except Exception as e:  # template errors (jinja's own, raise_exception) are the request's fault
            raise ValueError(f"cannot apply the chat template: {e}") from e

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        # one wake-up of each event loop per step, not one per request
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted by its client already
            if out.finished:
                del self._streams[out.request_id]
            batches.setdefault(stream._loop, []).append((stream, out))
        for loop, items in batches.items():
            _call_soon(loop, _post_outputs, items)

    def _fail_all(self, error: BaseException) -> None:
        logger.exception("engine loop failed; failing %d in-flight request(s)", len(self._streams))
        self._error = error
        dead = EngineDeadError("the engine failed; see the server log")
        for stream in set(self._streams.values()):
            stream._deliver(stream._post_error, dead)
        self._streams.clear()
        # answer commands that raced with the failure, so nobody waits for a dead thread
        self._answer_dead(dead)
        if self.on_dead is not None and not self._stopping:
            try:
                self.on_dead()
            except Exception:
                logger.exception("on_dead callback failed")

    def _answer_dead(self, dead: EngineDeadError) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                cmd[1]._deliver(cmd[1]._post_added, dead)
            elif cmd[0] == "call":
                _call_soon(cmd[4], _settle, cmd[3], None, dead)

    def _shutdown_engine(self) -> None:
        """On stop: abort what is left so its blocks go back, and fail the readers (503)."""
        gone = EngineDeadError("server is shutting down")
        for rid, stream in list(self._streams.items()):
            if self._error is None:
                try:
                    self.engine.abort_request(rid)
                except Exception:  # shutting down anyway; log and keep freeing the rest
                    logger.exception("abort of %s failed during shutdown", rid)
            stream._deliver(stream._post_error, gone)
        self._streams.clear()
        self._stopping = True
        self._answer_dead(gone)
        try:
            self.engine.close()  # an engine process is stopped and joined here
        except Exception:
            logger.exception("stopping the engine failed")


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # loop closed: the caller is gone
        pass


def _post_outputs(items: list[tuple[OutputStream, RequestOutput]]) -> None:
    for stream, out in items:
        stream._post_output(out)


def _settle(done: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if done.done():
        return
    if error is None:
        done.set_result(result)
    else:
        done.set_exception(error)
