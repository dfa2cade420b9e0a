"""The sweep of `atomc bench sweep`: the server under test and the benchmark cells run against it.

Where the server comes from is the config's `params.driver`:
- `atom` (or `atomc`): the suite starts `atomc serve` itself, in its own process group, and takes
  the whole group down afterwards (errors, Ctrl-C and SIGTERM included);
- `vllm_atom`, `sglang`, `vllm`, or any driver with `--base-url`: the user starts the server (vLLM,
  SGLang, another atomc) and the suite only sends requests to it.
The run order, blocks and report are `suite.py`'s; the config rules are `config.py`'s.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from atomc.bench.client import auth_headers
from atomc.bench.config import (
    SweepCell,
    SweepConfig,
    SweepConfigError,
    cell_key,
    client_timeout_s,
    load_sweep_config,
    resolve_threshold_path,
    server_ready_timeout_s,
    strip_private_keys,
)
from atomc.bench.metrics import parse_percentiles
from atomc.bench.serve import BenchConfig, run_benchmark

__all__ = [
    "SweepCell", "SweepConfig", "SweepConfigError", "cell_key", "load_sweep_config",
    "resolve_threshold_path", "strip_private_keys",
]  # fmt: skip

SERVER_LOG = "server.log"


class ServerUnavailable(RuntimeError):
    """The server under test never became ready (or exited): the run cannot start."""


# --- the server, when the sweep starts its own -------------------------------------------------


def check_can_launch(cfg: SweepConfig) -> None:
    """What `atomc serve` cannot be started for yet, said before anything runs."""
    p = cfg.params
    if p["nnodes"] > 1:
        raise SweepConfigError(
            f"params.nnodes={p['nnodes']}: atomc cannot launch a multi-node server yet (the sweep starts "
            "one server on this machine); start `atomc serve --nnodes N --node-rank R ...` on each node "
            "yourself and pass --base-url to gate them"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(model_id: str | None, port: int, extra_args: list[str]) -> list[str]:
    # no --model means the server's default model
    model = ["--model", model_id] if model_id else []
    return [sys.executable, "-m", "atomc.cli", "serve", *model, "--port", str(port), "--die-with-parent", *extra_args]


def native_server_args(cfg: SweepConfig) -> list[str]:
    """roles.server.atom_args, plus --max-model-len from params.max_model_length,
    --tensor-parallel-size from params.tensor_parallelism and --pipeline-parallel-size from
    params.pipeline_parallel_size, each unless given there."""
    args = list(cfg.server_args)

    def given(*flags: str) -> bool:
        return any(a in flags or a.startswith(tuple(f"{f}=" for f in flags)) for a in args)

    limit = cfg.params.get("max_model_length")
    if limit is not None and not given("--max-model-len"):
        args += ["--max-model-len", str(limit)]
    tp = cfg.params.get("tensor_parallelism", 1)
    if tp > 1 and not given("--tensor-parallel-size", "-tp"):
        args += ["--tensor-parallel-size", str(tp)]
    pp = cfg.params.get("pipeline_parallel_size", 1)
    if pp > 1 and not given("--pipeline-parallel-size", "-pp"):
        args += ["--pipeline-parallel-size", str(pp)]
    return args


def log_tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def wait_until_healthy(
    base_url: str, proc: subprocess.Popen | None, timeout_s: float, log_path: Path | None = None
) -> None:
    """Poll GET /health until 200; a started server that exits meanwhile ends the wait at once."""
    deadline = time.monotonic() + timeout_s
    tail = (lambda: log_tail(log_path)) if log_path else (lambda: "")
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServerUnavailable(f"server exited with code {proc.returncode}:\n{tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=5.0, trust_env=False).status_code == 200:
                return
        time.sleep(0.5)
    raise ServerUnavailable(f"server at {base_url} not healthy after {timeout_s:.0f}s:\n{tail()}")


def wait_until_serving(base_url: str, timeout_s: float, api_key: str | None = None) -> None:
    """For a server the user started: poll GET /v1/models (every OpenAI-compatible server has it,
    not all have /health) until 200, within the config's server waits."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        try:
            r = httpx.get(f"{base_url}/v1/models", headers=auth_headers(api_key), timeout=5.0, trust_env=False)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise ServerUnavailable(
                f"the server at {base_url} did not answer GET /v1/models within {timeout_s:g}s ({last})"
            )
        time.sleep(0.5)


def stop_process_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the server's whole group (it may have spawned workers), SIGKILL if it lingers."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit so `finally` blocks (which stop the server) still run."""
    try:
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def launched_server(cfg: SweepConfig, log_path: Path, log: Callable[[str], None] = print) -> Iterator[str]:
    """Start `atomc serve` in its own process group (on params.port_no, else a free port, with
    roles.server.env added to its environment), yield its base URL once /health answers 200, and
    always take the whole group down afterwards."""
    port = cfg.params.get("port_no") or free_port()
    cmd = server_command(cfg.model_id, port, native_server_args(cfg))
    base_url = f"http://127.0.0.1:{port}"
    log(f"starting server: {shlex.join(cmd)} (log: {log_path})")
    server_env = {**os.environ, **cfg.server_env}
    with open(log_path, "ab") as log_file, sigterm_as_exit():
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True, env=server_env)
        try:
            wait_until_healthy(base_url, proc, server_ready_timeout_s(cfg.params), log_path)
            log(f"server ready at {base_url}")
            yield base_url
        finally:
            stop_process_group(proc)


def external_base_url(cfg: SweepConfig, base_url: str | None) -> str | None:
    """The server a run uses without starting one: --base-url, else for an external driver
    params.base_url (+ port_no). None: start `atomc serve`."""
    if base_url:
        return base_url.rstrip("/")
    if cfg.native:
        return None
    url = cfg.params.get("base_url")
    if not url:
        raise SweepConfigError(
            f"params.driver={cfg.driver!r}: atomc does not start {cfg.driver} servers. Start the server "
            "yourself, then pass --base-url http://HOST:PORT (or set params.base_url and params.port_no)"
        )
    port = cfg.params.get("port_no")
    if port and not re.search(r":\d+/?$", url):
        url = f"{url.rstrip('/')}:{port}"
    return url.rstrip("/")


def session_key(cfg: SweepConfig, cell: SweepCell) -> tuple:
    """Cells with equal keys may share one server. CVS keys servers by shape too, so with
    `reuse_server_across_sweep: true` a new shape gets a fresh server; `false` restarts for every
    cell; unset (atomc's default) keeps one server for the whole sweep (its flags are the same)."""
    reuse = cfg.params.get("reuse_server_across_sweep")
    if reuse is None:
        return ()
    if reuse:
        return (cell.isl, cell.osl)
    return (cell.key,)


# --- running the cells -----------------------------------------------------------------------


def served_model(base_url: str, wanted: str | None, api_key: str | None) -> str:
    """`wanted` when the server lists it, else the first model it serves (model.id may be a path
    or null while the server names the model differently)."""
    resp = httpx.get(f"{base_url}/v1/models", headers=auth_headers(api_key), timeout=30.0, trust_env=False)
    resp.raise_for_status()
    ids = [m["id"] for m in resp.json().get("data") or []]
    if wanted in ids:
        return wanted
    if not ids:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return ids[0]


def bench_config_for(
    cell: SweepCell, cfg: SweepConfig, base_url: str, model: str, index: int = 0, **overrides
) -> BenchConfig:
    """The bench run of one cell. Cell `index` offsets the prompt seed: cells may share a server,
    so equal prompts would be prefix-cache hits on an earlier cell's."""
    params = cfg.params
    return BenchConfig(
        base_url=base_url,
        model=model,
        input_len=cell.isl,
        output_len=cell.osl,
        num_prompts=cell.num_prompts,
        max_concurrency=cell.concurrency,
        request_rate=float(params.get("request_rate", float("inf"))),
        seed=int(params.get("seed", 0)) + index,
        num_warmups=int(params.get("num_warmups", 0)),
        random_range_ratio=float(params.get("random_range_ratio", 0.0)),
        percentiles=parse_percentiles(params.get("metric_percentiles")),
        **overrides,
    )


def derived_metrics(result: dict, cell: SweepCell, params: dict) -> dict:
    """Per-GPU throughputs (TP x PP GPUs serve a cell) and, on a multi-node run with a single-node
    baseline, scaling efficiency: output tok/s against nnodes x the baseline, in percent."""
    gpus = cell.tp * cell.pp
    out = {}
    if result.get("total_token_throughput") is not None:
        out["per_gpu_throughput"] = result["total_token_throughput"] / gpus
    if result.get("output_throughput") is not None:
        out["output_tput_per_gpu"] = result["output_throughput"] / gpus
    baseline = params.get("scaling_baseline_output_throughput")
    if baseline and result.get("output_throughput") is not None:
        out["scaling.efficiency_pct"] = 100.0 * result["output_throughput"] / (baseline * params.get("nnodes", 1))
    return out


def timed_out_result(cell: SweepCell, timeout_s: float) -> dict:
    """A cell whose client ran past its budget: every request counts as failed, so gates on
    success_rate / failed catch it (and latencies are missing, so their gates SKIP)."""
    return {
        "num_prompts": cell.num_prompts,
        "completed": 0,
        "failed": cell.num_prompts,
        "success_rate": 0.0,
        "errors": [
            f"client did not finish within {timeout_s:g}s "
            "(params.client_initial_wait_s + client_poll_count x client_poll_wait_time)"
        ],
    }


def run_cell(cell: SweepCell, cfg: SweepConfig, url: str, model: str, index: int, **bench_kw) -> dict:
    bench = bench_config_for(cell, cfg, url, model, index, **bench_kw)
    timeout_s = client_timeout_s(cfg.params)
    try:
        result = run_benchmark(bench, timeout_s=timeout_s)
    except TimeoutError:
        result = timed_out_result(cell, timeout_s)
    return {
        "combo": cell.combo, "isl": cell.isl, "osl": cell.osl, "concurrency": cell.concurrency,
        **result, **derived_metrics(result, cell, cfg.params),
    }  # fmt: skip


def cell_file_name(prefix: str, key: str) -> str:
    return f"{prefix}_{key.replace('=', '').replace(',', '_')}.json"
