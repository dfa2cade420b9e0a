"""Servers for the block tests: the tiny llama behind `atomc serve`'s app, and small fakes.

The tiny llama (tests/conftest.py's random checkpoint) scores ~0 on anything, which is what the
end-to-end tests want: they check the pipeline and the gates, not the model. The fakes are
"oracles" that answer right, so a test can also see a perfect score come out of the same code.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

MAX_MODEL_LEN = 512


@contextlib.contextmanager
def tiny_llama_server(model_dir: Path) -> Iterator[tuple[str, str]]:
    """(base_url, served model name) of the real server app on a tiny llama, on CPU."""
    from atomc.config import EngineConfig
    from atomc.serve.server import ServerThread, build_server_app

    cfg = EngineConfig(device="cpu")
    cfg.model.model = str(model_dir)
    cfg.model.max_model_len = MAX_MODEL_LEN
    cfg.compile.enforce_eager = True
    cfg.cache.num_kv_blocks = 256
    cfg.scheduler.max_num_seqs = 8
    app = build_server_app(cfg)
    with ServerThread(app, app.state.atomc.config) as st:
        yield st.base_url, app.state.atomc.model_name


@contextlib.contextmanager
def fake_server(app) -> Iterator[str]:
    """A FastAPI app on a loopback port in a thread; yields its base URL."""
    import socket

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "fake server did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)


def completion(text: str, prompt_tokens: int = 0) -> dict:
    return {
        "id": "cmpl-fake",
        "object": "text_completion",
        "model": "fake",
        "choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1, "total_tokens": prompt_tokens + 1},
    }
