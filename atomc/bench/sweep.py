"""`atomc bench sweep`: read a CVS-style config, run every cell, gate it, write the results.

Config schema (CVS `schema_version: 1`, flat; keys starting with `_` are ignored):
  model.id, enforce_thresholds, threshold_json (a file next to the config),
  params.{num_prompts, tensor_parallelism, pipeline_parallel_size, random_range_ratio,
          metric_percentiles, server_ready_timeout_s, seed, request_rate, num_warmups},
  roles.server.atom_args (extra `atomc serve` flags, string or list),
  sweep.sequence_combinations [{name, isl, osl}], sweep.runs [{combo, concurrency, num_prompts?}]."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from atomc.bench.client import auth_headers
from atomc.bench.metrics import parse_percentiles
from atomc.bench.serve import BenchConfig, run_benchmark
from atomc.bench.thresholds import (
    GateRow,
    exit_code,
    gate_cells,
    load_thresholds,
    unmatched_threshold_cells,
)

RESULTS_FILE = "sweep_results.json"
SERVER_LOG = "server.log"


class SweepConfigError(ValueError):
    pass


def cell_key(isl: int, osl: int, tp: int, pp: int, concurrency: int) -> str:
    """The threshold key of a cell, exactly as CVS builds it (PP= always present)."""
    return f"ISL={isl},OSL={osl},TP={tp},PP={pp},CONC={concurrency}"


@dataclass(frozen=True)
class SweepCell:
    combo: str
    isl: int
    osl: int
    tp: int
    pp: int
    concurrency: int
    num_prompts: int

    @property
    def key(self) -> str:
        return cell_key(self.isl, self.osl, self.tp, self.pp, self.concurrency)


@dataclass
class SweepConfig:
    path: Path
    model_id: str | None
    params: dict
    cells: list[SweepCell]
    enforce_thresholds: bool = False
    threshold_json: str | None = None
    server_args: list[str] = field(default_factory=list)

    def sibling_threshold_path(self) -> Path | None:
        return self.path.parent / self.threshold_json if self.threshold_json else None


def strip_private_keys(obj):
    """Drop `_comment`-style keys at every level, as the CVS loader does."""
    if isinstance(obj, dict):
        return {k: strip_private_keys(v) for k, v in obj.items() if not str(k).startswith("_")}
    if isinstance(obj, list):
        return [strip_private_keys(v) for v in obj]
    return obj


def _positive_int(value, what: str) -> int:
    try:
        n = int(value)  # CVS writes isl/osl as strings in places
    except (TypeError, ValueError):
        raise SweepConfigError(f"{what} must be an integer, got {value!r}") from None
    if n <= 0:
        raise SweepConfigError(f"{what} must be positive, got {n}")
    return n


def split_args(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return shlex.split(value)
    if isinstance(value, list):
        return [str(v) for v in value]
    raise SweepConfigError(f"roles.server.atom_args must be a string or a list, got {value!r}")


def build_cells(sweep: dict, params: dict) -> list[SweepCell]:
    combos = {}
    for combo in sweep.get("sequence_combinations") or []:
        name = combo.get("name")
        if not name or name in combos:
            raise SweepConfigError(f"sequence_combinations needs unique names, got {name!r}")
        combos[name] = combo
    tp = _positive_int(params.get("tensor_parallelism", 1), "params.tensor_parallelism")
    pp = _positive_int(params.get("pipeline_parallel_size", 1), "params.pipeline_parallel_size")
    default_prompts = params.get("num_prompts")
    cells: list[SweepCell] = []
    for i, run in enumerate(sweep.get("runs") or []):
        combo = combos.get(run.get("combo"))
        if combo is None:
            raise SweepConfigError(f"sweep.runs[{i}] names unknown combo {run.get('combo')!r}")
        prompts = run.get("num_prompts", default_prompts)
        if prompts is None:
            raise SweepConfigError(f"sweep.runs[{i}]: set params.num_prompts or the run's num_prompts")
        cells.append(SweepCell(
            combo=combo["name"],
            isl=_positive_int(combo.get("isl"), f"combo {combo['name']!r} isl"),
            osl=_positive_int(combo.get("osl"), f"combo {combo['name']!r} osl"),
            tp=tp,
            pp=pp,
            concurrency=_positive_int(run.get("concurrency"), f"sweep.runs[{i}].concurrency"),
            num_prompts=_positive_int(prompts, f"sweep.runs[{i}].num_prompts"),
        ))
    if not cells:
        raise SweepConfigError("sweep.runs is empty: nothing to run")
    keys = [c.key for c in cells]
    if len(set(keys)) != len(keys):
        raise SweepConfigError(f"two runs share a cell key; results would collide: {keys}")
    return cells


def load_sweep_config(path: str | Path) -> SweepConfig:
    path = Path(path)
    raw = strip_private_keys(json.loads(path.read_text()))
    if str(raw.get("schema_version", 1)) != "1":
        raise SweepConfigError(f"{path}: only flat schema_version 1 is supported")
    params = raw.get("params") or {}
    server_role = (raw.get("roles") or {}).get("server") or {}
    return SweepConfig(
        path=path,
        model_id=(raw.get("model") or {}).get("id"),
        params=params,
        cells=build_cells(raw.get("sweep") or {}, params),
        enforce_thresholds=bool(raw.get("enforce_thresholds", False)),
        threshold_json=raw.get("threshold_json"),
        server_args=split_args(server_role.get("atom_args")),
    )


# --- the server, when the sweep starts its own -------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(model_id: str | None, port: int, extra_args: list[str]) -> list[str]:
    # no --model means the server's default model
    model = ["--model", model_id] if model_id else []
    return [sys.executable, "-m", "atomc.cli", "serve", *model, "--port", str(port), "--die-with-parent", *extra_args]


def log_tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def wait_until_healthy(base_url: str, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode}:\n{log_tail(log_path)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=5.0, trust_env=False).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"server not healthy after {timeout_s:.0f}s:\n{log_tail(log_path)}")


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
def launched_server(
    cfg: SweepConfig, log_path: Path, log: Callable[[str], None] = print
) -> Iterator[str]:
    """Start `atomc serve` in its own process group, yield its base URL once /health answers 200,
    and always take the whole group down afterwards (errors and Ctrl-C included)."""
    port = free_port()
    cmd = server_command(cfg.model_id, port, cfg.server_args)
    base_url = f"http://127.0.0.1:{port}"
    timeout_s = float(cfg.params.get("server_ready_timeout_s", 600))
    log(f"starting server: {shlex.join(cmd)} (log: {log_path})")
    with open(log_path, "ab") as log_file, sigterm_as_exit():
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_until_healthy(base_url, proc, timeout_s, log_path)
            log(f"server ready at {base_url}")
            yield base_url
        finally:
            stop_process_group(proc)


# --- running the cells -----------------------------------------------------------------------


def served_model(base_url: str, wanted: str | None, api_key: str | None) -> str:
    """`wanted` when the server lists it, else the first model it serves (model.id may be a path
    or null while the server names the model differently)."""
    resp = httpx.get(
        f"{base_url}/v1/models", headers=auth_headers(api_key), timeout=30.0, trust_env=False
    )
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
    """The bench run of one cell. Cell `index` offsets the prompt seed: every cell of a sweep runs
    against the same server, so equal prompts would be prefix-cache hits on an earlier cell's."""
    params = cfg.params
    return BenchConfig(
        base_url=base_url,
        model=model,
        input_len=cell.isl,
        output_len=cell.osl,
        num_prompts=cell.num_prompts,
        max_concurrency=cell.concurrency,
        request_rate=float(params.get("request_rate", math.inf)),
        seed=int(params.get("seed", 0)) + index,
        num_warmups=int(params.get("num_warmups", 0)),
        random_range_ratio=float(params.get("random_range_ratio", 0.0)),
        percentiles=parse_percentiles(params.get("metric_percentiles")),
        **overrides,
    )


@dataclass
class SweepOutcome:
    results: dict
    rows: list[GateRow]
    exit_code: int
    results_path: Path


def resolve_threshold_path(cfg: SweepConfig, explicit: str | Path | None) -> Path | None:
    """--threshold wins; else the config's sibling `threshold_json`; a named file must exist."""
    path = Path(explicit) if explicit else cfg.sibling_threshold_path()
    if path is not None and not path.is_file():
        raise SweepConfigError(f"threshold file not found: {path}")
    return path


def run_sweep(
    cfg: SweepConfig,
    base_url: str | None = None,
    output_dir: str | Path = ".",
    threshold_path: str | Path | None = None,
    enforce: bool | None = None,
    api_key: str | None = None,
    vocab_size: int | None = None,
    show_progress: bool = True,
    log: Callable[[str], None] = print,
) -> SweepOutcome:
    """Run every cell against `base_url` (or a server started here), then gate them all."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    threshold_file = resolve_threshold_path(cfg, threshold_path)
    thresholds = load_thresholds(threshold_file) if threshold_file else {}
    enforce = cfg.enforce_thresholds if enforce is None else enforce
    results_path = output_dir / RESULTS_FILE
    results: dict = {
        "config": str(cfg.path),
        "threshold_file": str(threshold_file) if threshold_file else None,
        "enforce_thresholds": enforce,
        "cells": {},
    }

    def save() -> None:
        # rewritten after every cell so a crash or Ctrl-C keeps what was measured
        results_path.write_text(json.dumps(results, indent=2) + "\n")

    server = contextlib.nullcontext(base_url) if base_url else launched_server(
        cfg, output_dir / SERVER_LOG, log
    )
    with server as url:
        url = url.rstrip("/")
        model = served_model(url, cfg.model_id, api_key)
        results.update(base_url=url, model=model)
        for i, cell in enumerate(cfg.cells, 1):
            log(f"[{i}/{len(cfg.cells)}] {cell.key} ({cell.combo}, {cell.num_prompts} prompts)")
            bench = bench_config_for(
                cell, cfg, url, model, i, api_key=api_key, vocab_size=vocab_size, show_progress=show_progress
            )
            results["cells"][cell.key] = {"combo": cell.combo, **run_benchmark(bench)}
            save()
    rows = gate_cells(results["cells"], thresholds)
    code = exit_code(rows, enforce)
    results.update(
        gates=[r.to_dict() for r in rows],
        unmatched_threshold_cells=unmatched_threshold_cells(results["cells"], thresholds),
        exit_code=code,
    )
    save()
    return SweepOutcome(results, rows, code, results_path)
