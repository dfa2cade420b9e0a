"""The engine in its own process, so HTTP work never holds the GIL the engine loop needs.

The server process keeps the tokenizer, checks and tokenizes prompts (`InputProcessor`) and sends
token ids down a pipe; the engine process runs `LLMEngine.step()` back to back and sends one message
per step with what changed: new token ids, new text, new logprobs, finish reasons. The server side
rebuilds cumulative `RequestOutput`s from those deltas, so `AsyncEngine` and the API drive an
`EngineProcessClient` exactly as they drive an in-process `LLMEngine` (both are `EngineClient`s,
engine/client.py).

    server process                                   engine process
    AsyncEngine thread --("add"/"abort"/"stop")-->   loop: commands, step(), send deltas
                       <--("step", deltas, stats)--

Lifetime: the engine process ignores SIGINT/SIGTERM (the server drains, then sends "stop") and
exits when the pipe closes, so a killed server leaves no engine behind. It is spawned, never
forked: a forked CUDA context is unusable.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from atomc.config import EngineConfig
from atomc.engine.client import EngineClient
from atomc.engine.inputs import InputProcessor
from atomc.outputs import CompletionOutput, RequestOutput
from atomc.sampling_params import SamplingParams

logger = logging.getLogger("atomc.serve")

# how long the server side waits for a step's message before it looks at its own commands again
_STEP_WAIT_S = 0.05
_STOP_TIMEOUT_S = 30.0


@dataclass
class EngineInfo:
    """What the server side needs to know about the engine, sent once it is ready."""

    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer_dir: str
    sampling_defaults: dict
    stats: dict
    startup_s: float


# ---------------------------------------------------------------- engine process


@dataclass
class _Sent:
    tokens: int = 0
    text: int = 0
    prompt_logprobs: bool = False


@dataclass
class OutputDeltas:
    """Engine side: turns cumulative outputs into what changed since the last message."""

    sent: dict[tuple[str, int], _Sent] = field(default_factory=dict)

    def encode(self, out: RequestOutput) -> tuple:
        seqs = []
        first = None
        for c in out.outputs:
            s = self.sent.setdefault((out.request_id, c.index), _Sent())
            first = first or s
            # text only grows, except a stop string cutting its tail: keep the common prefix
            keep = min(s.text, len(c.text))
            logprobs = c.logprobs[s.tokens :] if c.logprobs is not None else None
            seqs.append(
                (c.index, c.token_ids[s.tokens :], keep, c.text[keep:], logprobs)
                + (c.finish_reason, c.stop_reason, c.cumulative_logprob)
            )
            s.tokens, s.text = len(c.token_ids), len(c.text)
        prompt_logprobs = None
        if out.prompt_logprobs is not None and first is not None and not first.prompt_logprobs:
            prompt_logprobs, first.prompt_logprobs = out.prompt_logprobs, True
        if out.finished:
            self.forget(out.request_id, len(out.outputs))
        return (out.request_id, out.finished, out.num_cached_tokens, prompt_logprobs, out.metrics, seqs, out.error)

    def forget(self, request_id: str, n: int) -> None:
        for i in range(n):
            self.sent.pop((request_id, i), None)


def _portable(e: BaseException) -> BaseException:
    """An exception that survives pickling, keeping ValueError (the user's mistake) as it is."""
    if isinstance(e, ValueError | FileNotFoundError | RuntimeError):
        return type(e)(str(e))
    return RuntimeError(f"{type(e).__name__}: {e}")


def run_engine_process(config: EngineConfig, conn, spawned_at: float | None = None) -> None:
    """Entry point of the engine process. `spawned_at`: the server's `time.time()` at spawn, so the
    start-up log can say what the spawn (a fresh interpreter, unpickling the config) cost."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    t0 = time.perf_counter()
    try:
        from atomc.engine.llm_engine import LLMEngine

        spawn_s = f"{time.time() - spawned_at - (time.perf_counter() - t0):.1f}s" if spawned_at else "?"
        logger.info("start-up: engine process spawned in %s, engine imports %.1fs", spawn_s, time.perf_counter() - t0)
        engine = LLMEngine(config, decode_only_tokenizer=True)  # the server tokenizes
        info = EngineInfo(
            model_name=engine.model_name,
            max_model_len=engine.max_model_len,
            vocab_size=engine.arch.vocab_size,
            tokenizer_dir=str(Path(config.model.tokenizer or engine.model_dir)),
            sampling_defaults=dict(engine.sampling_defaults),
            stats=engine.stats(),
            startup_s=time.perf_counter() - t0,
        )
    except BaseException as e:  # start-up failure: the server reports it and exits non-zero
        logger.debug("engine start-up failed", exc_info=True)
        try:
            conn.send(("failed", _portable(e), traceback.format_exc()))
        except OSError:
            logger.info("start-up failed and the server is gone: %s: %s", type(e).__name__, e)
        return
    try:
        conn.send(("ready", info))
        _serve_pipe(engine, conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        # the server is gone (it may have stopped during start-up, with its own error): nothing to report to
        logger.info("the server is gone: the engine stops")
    except BaseException as e:
        logger.exception("engine loop failed")
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        raise SystemExit(1) from e
    finally:
        engine.close()  # tensor-parallel workers stop with the engine


def _serve_pipe(engine, conn) -> None:
    deltas = OutputDeltas()
    while True:
        if not engine.has_unfinished_requests():
            conn.poll(None)  # idle: sleep until a command (or EOF, which recv turns into EOFError)
        failed: list[tuple[str, str]] = []
        handled = 0
        while conn.poll(0):
            msg = conn.recv()
            kind = msg[0]
            if kind == "stop":
                return
            handled += 1
            if kind == "add":
                _, rid, ids, params, arrival = msg
                try:
                    engine.add_request(rid, ids, params, arrival_time=arrival)
                except Exception as e:  # the server checked the prompt already: this is a bug, not a 400
                    logger.exception("adding request %s failed", rid)
                    failed.append((rid, f"{type(e).__name__}: {e}"))
            elif kind == "abort":
                out = engine.abort_request(msg[1])
                if out is not None:
                    deltas.forget(msg[1], len(out.outputs))
        outputs = engine.step() if engine.has_unfinished_requests() else []
        if outputs or failed or handled:
            # `handled` acknowledges commands: the server side waits for it, so its stats are fresh
            conn.send(("step", [deltas.encode(o) for o in outputs], failed, handled, engine.stats()))


# ---------------------------------------------------------------- server process


class _Assembly:
    """Server side: one request's cumulative output, rebuilt from deltas."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], n: int):
        self.request_id, self.prompt, self.prompt_ids = request_id, prompt, prompt_ids
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.text = [""] * n
        self.logprobs: list[list | None] = [None] * n
        self.ends: list[tuple] = [(None, None, None)] * n  # finish_reason, stop_reason, cumulative logprob
        self.prompt_logprobs = None

    def apply(self, delta: tuple) -> RequestOutput:
        _, finished, num_cached, prompt_logprobs, metrics, seqs, error = delta
        if prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs
        for index, tokens, keep, text, logprobs, *ends in seqs:
            self.tokens[index].extend(tokens)
            self.text[index] = self.text[index][:keep] + text
            if logprobs is not None:
                if self.logprobs[index] is None:
                    self.logprobs[index] = []
                self.logprobs[index].extend(logprobs)
            self.ends[index] = tuple(ends)
        out = self.output(finished, num_cached, metrics)
        out.error = error
        return out

    def output(self, finished: bool, num_cached: int = 0, metrics: dict | None = None) -> RequestOutput:
        # fresh lists each time: the event loop reads these while the next delta arrives
        outputs = [
            CompletionOutput(i, self.text[i], list(self.tokens[i]), *self.ends[i][:2], None, self.ends[i][2])
            for i in range(len(self.tokens))
        ]
        for c, lps in zip(outputs, self.logprobs, strict=True):
            c.logprobs = list(lps) if lps is not None else None
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_ids, outputs, finished, num_cached,
            self.prompt_logprobs, dict(metrics or {}),
        )  # fmt: skip


def early_tokenizer_dir(config: EngineConfig) -> Path | None:
    """The tokenizer folder, when it is known without the engine's model resolution (a .gguf file or
    the default model is resolved, maybe converted, in the engine process: then None)."""
    if config.model.tokenizer:
        return Path(config.model.tokenizer).expanduser().resolve()
    if config.model.model and (Path(config.model.model).expanduser() / "config.json").is_file():
        return Path(config.model.model).expanduser().resolve()
    return None


class EarlyTokenizer:
    """Loads the server side's tokenizer on a thread while the engine process starts (both take
    seconds: transformers' import and the tokenizer file); `result` falls back to a load now when
    the engine names another folder or the early load failed (the engine reports a bad folder)."""

    def __init__(self, path: Path | None):
        self.path, self._tok, self._error, self.load_s = path, None, None, 0.0
        self._thread = None
        if path is not None:
            self._thread = threading.Thread(target=self._load, name="atomc-tokenizer", daemon=True)
            self._thread.start()

    def _load(self) -> None:
        from atomc.engine.tokenizer import load_tokenizer

        t0 = time.perf_counter()
        try:
            self._tok = load_tokenizer(self.path)
        except Exception as e:  # noqa: BLE001 - reported by result() if this folder is the one used
            self._error = e
        self.load_s = time.perf_counter() - t0

    def result(self, path: Path):
        from atomc.engine.tokenizer import load_tokenizer

        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
        if self._tok is not None and Path(path).resolve() == self.path:
            logger.info(
                "start-up: server-side tokenizer %.1fs, overlapped with the engine's start (%.1fs waited after it)",
                self.load_s,
                time.perf_counter() - t0,
            )
            return self._tok
        tok = load_tokenizer(Path(path))
        logger.info("start-up: server-side tokenizer %.1fs, after the engine's start", time.perf_counter() - t0)
        return tok


class EngineProcessClient(EngineClient):
    """The `EngineClient` interface `AsyncEngine` drives, served by an engine process over a pipe.

    Not thread-safe, like `LLMEngine`: one thread (AsyncEngine's) calls everything but `alive`.
    """

    def __init__(self, config: EngineConfig, before_wait=None):
        """`before_wait`: work of the caller's to do while the engine process starts (imports)."""
        self.config = config
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        args = (config, child, time.time())
        self._proc = ctx.Process(target=run_engine_process, args=args, name="atomc-engine")
        self._proc.start()
        child.close()
        if before_wait is not None:
            before_wait()
        # this side's tokenizer loads while the engine process starts, not after it (seconds each);
        # its thread starts after the caller's imports, so no two threads of ours import at once
        early = EarlyTokenizer(early_tokenizer_dir(config))
        info = self._wait_ready()
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.sampling_defaults = info.sampling_defaults
        self.tokenizer = early.result(Path(info.tokenizer_dir))
        self.inputs = InputProcessor(self.tokenizer, info.vocab_size, info.max_model_len, config.serve.chat_template)
        self._stats = info.stats
        self._live: dict[str, _Assembly] = {}
        self._unacked = 0  # commands sent that no step message has acknowledged yet

    def _wait_ready(self) -> EngineInfo:
        while not self._conn.poll(1.0):
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine process exited during start-up (exit code {self._proc.exitcode})")
        try:
            msg = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(f"the engine process exited during start-up (exit code {self._proc.exitcode})") from None
        if msg[0] == "failed":
            self._proc.join(5)
            raise msg[1]
        return msg[1]

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    # -- the EngineClient interface (tokenize, chat template, defaults: inherited) --------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        add_special_tokens: bool = True,
    ) -> None:
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.inputs.prompt_ids(prompt, params, add_special_tokens)
        text = prompt if isinstance(prompt, str) else None
        self._conn.send(("add", request_id, ids, params, arrival_time or time.perf_counter()))
        self._unacked += 1
        self._live[request_id] = _Assembly(request_id, text, ids, params.num_samples)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self._live.pop(request_id, None)
        if req is None:
            return None
        self._conn.send(("abort", request_id))
        self._unacked += 1
        out = req.output(True)
        for c in out.outputs:
            c.finish_reason = c.finish_reason or "abort"
        return out

    def has_unfinished_requests(self) -> bool:
        # commands not yet acknowledged count too: AsyncEngine keeps stepping until the engine
        # process has seen them, so stats after an abort show the blocks freed
        return bool(self._live) or self._unacked > 0

    def stats(self) -> dict:
        return self._stats

    def step(self) -> list[RequestOutput]:
        """Outputs of the engine steps that finished since the last call (waits up to 50 ms for one)."""
        outputs: list[RequestOutput] = []
        if not self._conn.poll(_STEP_WAIT_S):
            return outputs
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                self._proc.join(1)
                raise RuntimeError(f"the engine process exited (exit code {self._proc.exitcode})") from None
            if msg[0] == "error":
                raise RuntimeError(f"the engine process failed: {msg[1]}")
            _, deltas, failed, handled, self._stats = msg
            self._unacked -= handled
            outputs.extend(self._apply(deltas, failed))
            if not self._conn.poll(0):
                return outputs

    def _apply(self, deltas: list[tuple], failed: list[tuple[str, str]]) -> list[RequestOutput]:
        outputs = []
        for delta in deltas:
            req = self._live.get(delta[0])
            if req is None:
                continue  # aborted here while that step ran
            if delta[1]:
                del self._live[delta[0]]
            outputs.append(req.apply(delta))
        for rid, error in failed:
            req = self._live.pop(rid, None)
            if req is not None:
                logger.error("engine could not add request %s: %s", rid, error)
                out = req.output(True)
                for c in out.outputs:
                    c.finish_reason = "abort"
                out.error = error
                outputs.append(out)
        return outputs

    def kill(self) -> None:
        """Kill the engine process now (SIGKILL: it ignores SIGTERM) and reap it; the pipe is left
        to the interpreter's exit, since the AsyncEngine thread may still be reading it."""
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(5)

    def close(self, timeout: float = _STOP_TIMEOUT_S) -> None:
        """Stop the engine process: ask, then terminate, then kill."""
        if self._proc.is_alive():
            try:
                self._conn.send(("stop",))
            except OSError:
                pass
            self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()
