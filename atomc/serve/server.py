"""`atomc serve`: load the engine, serve the app with uvicorn, drain on SIGTERM.

Start-up: the port is bound first (`bind_socket`), so a busy or invalid port fails in a second with
one line, before the model loads; a SIGTERM during start-up exits non-zero (nothing was served).

Shutdown: on SIGTERM (or Ctrl-C) uvicorn stops accepting connections and lets in-flight requests,
streams included, finish for up to `serve.drain_timeout_s`; then the app cuts what is left (a 503,
or an SSE error event then `[DONE]`; each aborts its engine request), the app's lifespan stops the
engine thread, and the process exits with status 0. A second Ctrl-C during the drain stops at once
(open streams are cut, the engine process is killed) and exits 130. If the engine dies for good the server stops
at once and exits 1, so a supervisor restarts it; /health answers 503 meanwhile.

Parent death: with `--die-with-parent` (ServeConfig.die_with_parent) the server asks Linux
(prctl PR_SET_PDEATHSIG) for a SIGTERM when its parent exits, so a harness that spawns
`atomc serve` and is killed leaves no server behind. It is opt-in because `nohup atomc serve &`
from a shell that then exits must keep serving. The engine process (`serve.engine_process`, on by
default on a GPU) exits by itself when the server's end of its pipe closes, so it never outlives
the server.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import time

import uvicorn

from atomc.config import EngineConfig
from atomc.serve.access_log import uvicorn_log_config
from atomc.serve.http_protocol import header_timeout_protocol

logger = logging.getLogger("atomc.serve")

_PR_SET_PDEATHSIG = 1
_PARENT_AT_START = os.getppid()  # read at import, before any re-parenting could happen


def die_with_parent() -> bool:
    """Get SIGTERM when the parent process exits (Linux only); True when armed.

    The kernel tracks the parent *thread*: a parent that spawns us from a short-lived thread
    should not set the flag.
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        return False
    # the parent may have died before prctl ran: then we were already re-parented
    if os.getppid() != _PARENT_AT_START:
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def _exit_zero_on_sigterm() -> None:
    # uvicorn re-raises the signal once it has drained; exiting 0 then tells supervisors "clean stop"
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))


def _exit_nonzero_on_sigterm() -> None:
    # during start-up nothing is served yet: a stop then is not a clean one (128 + SIGTERM, as a shell)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signal.SIGTERM))


def check_serve_config(config: EngineConfig) -> None:
    """Refuse settings that would quietly serve less safely than asked, before anything loads."""
    s = config.serve
    if s.api_key is not None and not s.api_key.strip():
        raise ValueError("--api-key is empty, which would turn authentication off; leave the flag out instead")
    for name in ("max_prompts_per_request", "max_seqs_per_request", "max_logprob_entries_per_request"):
        if getattr(s, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(s, name)}")
    if s.request_body_timeout_s <= 0 or s.request_header_timeout_s <= 0 or s.drain_timeout_s < 0:
        raise ValueError("--request-body-timeout and --request-header-timeout must be > 0, --drain-timeout >= 0")
    check_output_parsers(s)


def check_output_parsers(s) -> None:
    """Unknown parser names and --enable-auto-tool-choice without a parser fail at start-up, and
    the harmony parsers load their encoding now rather than on the first request."""
    from atomc.serve.reasoning_parsers import reasoning_parser_class
    from atomc.serve.tool_parsers import tool_parser_class

    if s.enable_auto_tool_choice and not s.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME")
    if s.tool_call_parser is not None:
        tool_parser_class(s.tool_call_parser)
    if s.reasoning_parser is not None:
        reasoning_parser_class(s.reasoning_parser)
    if "openai" in (s.tool_call_parser, s.reasoning_parser):
        from atomc.serve.harmony_stream import harmony_encoding

        harmony_encoding()


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind and listen before anything slow, so a bad or busy port fails in a second with one line."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve --host {host!r}: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


# exit status of a stop forced by a second Ctrl-C: 128 + SIGINT, as a shell reports it
_FORCED_EXIT = 128 + signal.SIGINT

# uvicorn's own deadline comes this long after ours, so the app cuts streams cleanly first
_DRAIN_GRACE_S = 2.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server, telling the app when shutdown begins so it can cut what still runs at the
    end of the drain with an error event instead of a broken body (ServerState.begin_drain)."""

    def __init__(self, config: uvicorn.Config, drain_s: float):
        super().__init__(config)
        self.drain_s = drain_s
        self.forced = False  # a second Ctrl-C came during the drain

    def handle_exit(self, sig: int, frame) -> None:
        # uvicorn's own rule: a SIGINT while already stopping skips the drain and the app's shutdown
        if self.should_exit and sig == signal.SIGINT and not self.forced:
            self.forced = True
            logger.warning("second Ctrl-C: stopping now, without draining (exit status %d)", _FORCED_EXIT)
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        state = getattr(getattr(self.config.app, "state", None), "atomc", None)
        if state is not None:
            state.begin_drain(self.drain_s)
        await super().shutdown(sockets)


def make_server(app, config: EngineConfig, **overrides) -> DrainingServer:
    return DrainingServer(uvicorn_config(app, config, **overrides), config.serve.drain_timeout_s)


def uvicorn_config(app, config: EngineConfig, **overrides) -> uvicorn.Config:
    serve = config.serve
    log_config = uvicorn_log_config(serve.disable_access_log_for_endpoints)
    kw = dict(
        host=config.serve.host,
        port=config.serve.port,
        timeout_graceful_shutdown=config.serve.drain_timeout_s + _DRAIN_GRACE_S,
        timeout_keep_alive=config.serve.timeout_keep_alive_s,
        # one request's header block (uvicorn's h11 default is 16 KiB)
        h11_max_incomplete_event_size=config.serve.max_header_bytes,
        http=header_timeout_protocol(config.serve.request_header_timeout_s),
        log_level="info",
        lifespan="on",
        access_log=not serve.disable_uvicorn_access_log,
    )
    if log_config is not None:
        kw["log_config"] = log_config
    kw.update(overrides)
    return uvicorn.Config(app, **kw)


def uses_engine_process(config: EngineConfig) -> bool:
    """`serve.engine_process`: on, off, or auto = on for a GPU engine. On the 2-core CPU box the
    extra process cost more than the GIL it frees (tiny model: 5.0k vs 6.5k tok/s, +4 s start).

    auto with `--device auto` looks for a GPU device node instead of asking torch: importing torch
    and CUDA here took 4.8 s, all of it before the engine process was spawned."""
    mode = config.serve.engine_process
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"--engine-process must be auto, on or off; got {mode!r}")
    if mode == "auto":
        if config.device == "auto":
            from atomc.platforms import gpu_device_nodes_present

            return gpu_device_nodes_present()
        return config.device != "cpu"
    return mode == "on"


def build_server_app(config: EngineConfig, on_dead=None):
    """Load the model (slow) and wrap it in the app; the engine thread starts with the app.

    `on_dead` runs (on the engine thread) when the engine fails for good; `run_server` stops the
    server with a non-zero status on it.

    With an engine process (`serve.engine_process`, see `uses_engine_process`) the model lives in
    a spawned process (engine_process.py) and this process keeps only the tokenizer and the HTTP side.
    """
    t0 = time.perf_counter()
    if uses_engine_process(config):
        # spawned first: the engine process starts while this one imports the HTTP side
        from atomc.engine.process import EngineProcessClient

        engine = EngineProcessClient(config, before_wait=_import_http_side)
    else:
        from atomc.engine.llm_engine import LLMEngine

        _import_http_side()
        engine = LLMEngine(config)
    t1 = time.perf_counter()
    from atomc.serve.api import build_app
    from atomc.serve.async_engine import AsyncEngine

    app = build_app(AsyncEngine(engine, on_dead=on_dead), config)
    logger.info("start-up: engine %.1fs, HTTP app %.1fs", t1 - t0, time.perf_counter() - t1)
    return app


def _import_http_side() -> None:
    t0 = time.perf_counter()
    import atomc.serve.api  # noqa: F401 - FastAPI and pydantic: about a second
    import atomc.serve.async_engine  # noqa: F401

    logger.info("start-up: HTTP side imported in %.1fs", time.perf_counter() - t0)


def prepare_process(config: EngineConfig) -> None:
    """Process-level setup for a server that owns its process: parent-death guard, SIGTERM, logging."""
    if config.serve.die_with_parent:
        die_with_parent()
    if threading.current_thread() is threading.main_thread():
        _exit_nonzero_on_sigterm()
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


class _Serving:
    """The uvicorn server of `atomc serve`, and whether it stopped because the engine died."""

    def __init__(self):
        self.server: uvicorn.Server | None = None
        self.engine_died = False

    def engine_dead(self) -> None:
        # from the engine thread: /health already says 503; stop now (the failed streams end at once)
        self.engine_died = True
        logger.error("the engine failed for good; stopping the server (exit status 1)")
        if self.server is not None:
            self.server.should_exit = True


def serve_app(app, config: EngineConfig, sock: socket.socket | None = None, serving: _Serving | None = None) -> int:
    """Blocking: serve until SIGTERM / SIGINT, drain (up to `serve.drain_timeout_s`), stop the engine.
    Returns the exit status: 0 for a stop asked for, 1 when the engine died, 130 when a second
    Ctrl-C cut the drain short (the engine process, if any, is killed then: nothing drained it)."""
    serving = serving or _Serving()
    serving.server = make_server(app, config)
    if threading.current_thread() is threading.main_thread():
        _exit_zero_on_sigterm()  # serving now: a SIGTERM from here on is a clean stop
    try:
        serving.server.run(sockets=[sock] if sock is not None else None)
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its drain: that is a clean stop here
        pass
    if serving.server.forced:
        # uvicorn skipped the app's shutdown: stop the engine here, or exit would wait for its process
        state = getattr(app.state, "atomc", None)
        if state is not None:
            state.engine.kill()
        return _FORCED_EXIT
    return 1 if serving.engine_died else 0


def run_server(config: EngineConfig) -> int:
    """`atomc serve`: bind the port, load the model, then serve it until SIGTERM / SIGINT."""
    prepare_process(config)
    check_serve_config(config)
    sock = bind_socket(config.serve.host, config.serve.port)  # before the slow load: fail fast
    logger.info("start-up: listening on %s:%d; loading the model", config.serve.host, sock.getsockname()[1])
    t0 = time.perf_counter()
    serving = _Serving()
    app = build_server_app(config, on_dead=serving.engine_dead)
    srv = app.state.atomc
    logger.info(
        "serving %s (max_model_len %d) on http://%s:%d; loaded in %.1fs",
        srv.model_name,
        srv.engine.max_model_len,
        config.serve.host,
        sock.getsockname()[1],
        time.perf_counter() - t0,
    )
    return serve_app(app, config, sock, serving)


class ServerThread:
    """uvicorn on a background thread, on a socket bound up front (port 0 = any free port).

    For tests and in-process use (no signal handling off the main thread): `stop()` drains like
    SIGTERM does.
    """

    def __init__(self, app, config: EngineConfig, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = make_server(app, config, host=host, port=self.port, log_level=log_level)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="atomc-uvicorn", daemon=True
        )

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        with contextlib.suppress(OSError):
            self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
