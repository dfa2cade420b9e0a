"""`atomc serve`: load the engine, serve the app with uvicorn, drain on SIGTERM.

Shutdown: on SIGTERM (or Ctrl-C) uvicorn stops accepting connections and lets in-flight requests,
streams included, finish for up to `serve.drain_timeout_s`; then it cancels what is left (each
cancelled request aborts its engine request), the app's lifespan stops the engine thread, and the
process exits with status 0.

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


def uvicorn_config(app, config: EngineConfig, **overrides) -> uvicorn.Config:
    kw = dict(
        host=config.serve.host,
        port=config.serve.port,
        timeout_graceful_shutdown=config.serve.drain_timeout_s,
        log_level="info",
        lifespan="on",
    )
    kw.update(overrides)
    return uvicorn.Config(app, **kw)


def uses_engine_process(config: EngineConfig) -> bool:
    """`serve.engine_process`: on, off, or auto = on for a GPU engine. On the 2-core CPU box the
    extra process cost more than the GIL it frees (tiny model: 5.0k vs 6.5k tok/s, +4 s start)."""
    mode = config.serve.engine_process
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"--engine-process must be auto, on or off; got {mode!r}")
    if mode == "auto":
        from atomc.config import resolve_device

        return resolve_device(config.device) != "cpu"
    return mode == "on"


def build_server_app(config: EngineConfig):
    """Load the model (slow) and wrap it in the app; the engine thread starts with the app.

    With an engine process (`serve.engine_process`, see `uses_engine_process`) the model lives in
    a spawned process (engine_process.py) and this process keeps only the tokenizer and the HTTP side.
    """
    from atomc.serve.api import build_app
    from atomc.serve.async_engine import AsyncEngine

    if uses_engine_process(config):
        from atomc.engine.process import EngineProcessClient

        engine = EngineProcessClient(config)
    else:
        from atomc.engine.llm_engine import LLMEngine

        engine = LLMEngine(config)
    return build_app(AsyncEngine(engine), config)


def prepare_process(config: EngineConfig) -> None:
    """Process-level setup for a server that owns its process: parent-death guard, SIGTERM, logging."""
    if config.serve.die_with_parent:
        die_with_parent()
    if threading.current_thread() is threading.main_thread():
        _exit_zero_on_sigterm()
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def serve_app(app, config: EngineConfig) -> None:
    """Blocking: serve until SIGTERM / SIGINT, drain (up to `serve.drain_timeout_s`), stop the engine."""
    try:
        uvicorn.Server(uvicorn_config(app, config)).run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its drain: that is a clean stop here
        pass


def run_server(config: EngineConfig) -> None:
    """`atomc serve`: load the model, then serve it until SIGTERM / SIGINT."""
    prepare_process(config)
    t0 = time.perf_counter()
    app = build_server_app(config)
    srv = app.state.atomc
    logger.info(
        "serving %s (max_model_len %d) on http://%s:%d; loaded in %.1fs",
        srv.model_name,
        srv.engine.max_model_len,
        config.serve.host,
        config.serve.port,
        time.perf_counter() - t0,
    )
    serve_app(app, config)


class ServerThread:
    """uvicorn on a background thread, on a socket bound up front (port 0 = any free port).

    For tests and in-process use (no signal handling off the main thread): `stop()` drains like
    SIGTERM does.
    """

    def __init__(self, app, config: EngineConfig, host: str = "127.0.0.1", port: int = 0):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(app, config, host=host, port=self.port, log_level="warning"))
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
