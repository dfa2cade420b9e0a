"""One CVS run of `atomc bench sweep`: the order things run in, the gates, and the report JSON.

Order (the page's): thresholds are resolved and, when enforcing, checked for coverage before any
server starts (a config error costs seconds, not a sweep); then the server (started here, or the
user's); `before` blocks (functional FUNC-1/2) on the fresh server; `during` blocks (platform
INF-6/7) start; every sweep cell; `during` blocks stop; `after` blocks (mtp_quality, accuracy,
long-context, ...); then every cell and block is gated and the report written. The report
(`report.json`, schema in docs/benchmarking.md) is rewritten after every cell and block, so an
interrupted run keeps what it measured; the run deck renders it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from itertools import groupby
from pathlib import Path

from atomc.bench import sweep as sw
from atomc.bench.blocks import BlockResult, SuiteContext, registry
from atomc.bench.config import (
    SweepConfig,
    SweepConfigError,
    load_thresholds,
    resolve_threshold_path,
    server_ready_timeout_s,
)
from atomc.bench.thresholds import (
    GateRow,
    Status,
    coverage_problems,
    gate_block,
    gate_cells,
    is_cell_key,
    unmatched_threshold_cells,
)

REPORT_FILE = "report.json"
REPORT_SCHEMA = "atomc.bench.report/1"
TOPOLOGY_FIELDS = ("tensor_parallelism", "pipeline_parallel_size", "nnodes", "master_addr", "master_port")


@dataclass
class SuiteOutcome:
    report: dict
    rows: list[GateRow]
    blocks: list[BlockResult]
    exit_code: int
    report_path: Path


def _now() -> str:
    return datetime.now().isoformat(timespec="seconds")


def json_safe(obj):
    """JSON has no infinity or NaN: write them as strings, as vLLM's results do for the rate."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def write_json(path: Path, obj) -> None:
    """`obj` as JSON at `path`, whole or not at all: written beside it, then renamed over it, so a run
    stopped mid-write (the suite timeout's SIGTERM) leaves the last complete file for the deck."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(json_safe(obj), indent=2) + "\n")
    os.replace(tmp, path)


def check_thresholds(cfg: SweepConfig, thresholds: dict, enforce: bool) -> list[str]:
    """The page's coverage rule. Enforcing: an incomplete file is a config error (every gap listed);
    record-only: the gaps come back as notes."""
    p = cfg.params
    scaling = p["nnodes"] > 1 and p["scaling_baseline_output_throughput"] is not None
    problems = coverage_problems([c.key for c in cfg.cells], thresholds, scaling)
    if problems and enforce:
        raise SweepConfigError(
            "enforce_thresholds is true but the threshold file does not cover the run:\n  - "
            + "\n  - ".join(problems)
            + "\n(add the specs, use kind 'info' to record a metric without gating it, or run --no-enforce)"
        )
    return [f"record-only: {p}" for p in problems]


def block_gates(results: list[BlockResult], thresholds: dict) -> list[GateRow]:
    """Gate rows for the blocks the suite gates (self-gated blocks judge their own figures)."""
    rows = []
    for result in results:
        entry = registry.BY_NAME.get(result.block)
        if entry is not None and entry.self_gated:
            continue
        specs = thresholds.get(result.block)
        if isinstance(specs, dict):
            rows.extend(gate_block(result.block, result.metrics, specs))
    return rows


def max_failed_rows(cells: dict[str, dict], limit: int | None) -> list[GateRow]:
    """params.bench_max_failed_requests: a cell with more failed requests than that fails."""
    if limit is None:
        return []
    rows = []
    for key, m in cells.items():
        failed = m.get("failed")
        ok = failed is not None and failed <= limit
        reason = f"{failed} failed requests {'<=' if ok else '>'} params.bench_max_failed_requests {limit}"
        rows.append(GateRow(key, "failed", "max", f"<= {limit}", failed, Status.PASS if ok else Status.FAIL, reason))
    return rows


def suite_exit_code(rows: list[GateRow], blocks: list[BlockResult], enforce: bool) -> int:
    """1 when enforcing and a gate FAILed or a configured block FAILed / could not run (ERROR);
    SKIP never fails a run. Record-only runs exit 0."""
    if not enforce:
        return 0
    bad_gate = any(r.status is Status.FAIL for r in rows)
    bad_block = any(b.verdict in ("FAIL", "ERROR") for b in blocks)
    return 1 if bad_gate or bad_block else 0


def summarize(rows: list[GateRow], blocks: list[BlockResult]) -> dict:
    counts = Counter(str(r.status) for r in rows)
    out = {s: counts[s] for s in ("PASS", "FAIL", "SKIP", "INFO")}
    out["blocks_failed"] = sum(b.verdict in ("FAIL", "ERROR") for b in blocks)
    return out


def preflight(cfg: SweepConfig, base_url: str | None, thresholds: dict, enforce: bool, log) -> tuple:
    """Everything checked before a server starts: coverage, blocks, where the server comes from.
    Returns (the chosen blocks, the external server's URL or None, the run's notes)."""
    notes = list(cfg.notes) + check_thresholds(cfg, thresholds, enforce)
    try:
        chosen = registry.configured_blocks(cfg.blocks)
    except ValueError as exc:
        raise SweepConfigError(str(exc)) from None
    external = sw.external_base_url(cfg, base_url)
    p = cfg.params
    if external is None:
        sw.check_can_launch(cfg)
    else:
        if not cfg.native:
            log(f"driver {cfg.driver}: atomc starts no {cfg.driver} server; using the one you started at {external}")
        if p["reuse_server_across_sweep"] is False:
            notes.append("reuse_server_across_sweep=false has no effect on an external server: atomc restarts nothing")
        if p["nnodes"] > 1:
            notes.append(f"multi-node run (nnodes={p['nnodes']}): the servers were started by the user")
    names = {e.name for e, _ in chosen}
    stray = [k for k in thresholds if not is_cell_key(k) and k not in names]
    notes += [f"threshold entry {k!r} gates no block of this run" for k in stray]
    return chosen, external, notes


def shown_path(path: Path | str | None) -> str | None:
    """A path as a report shows it: relative to the working directory when it lies under it (a
    report is shared, and the folder it ran in means nothing elsewhere), else as given."""
    if path is None:
        return None
    path = Path(path)
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    return str(path)


def new_report(cfg: SweepConfig, external: str | None, enforce: bool, threshold_file: Path | None, notes: list) -> dict:
    p = cfg.params
    return {
        "schema": REPORT_SCHEMA,
        "started_at": _now(),
        "finished_at": None,
        "config": shown_path(cfg.path),
        "profile": cfg.profile,
        "schema_version": cfg.schema_version,
        "framework": cfg.framework,
        "gpu_arch": cfg.gpu_arch,
        "run_card": cfg.run_card,
        "driver": cfg.driver,
        "server_started": external is None,
        "base_url": external,
        "model": None,
        "model_id": cfg.model_id,
        "topology": {k: p[k] for k in TOPOLOGY_FIELDS},
        "params": p,
        "enforce_thresholds": enforce,
        "threshold_file": shown_path(threshold_file),
        "cells": {},
        "blocks": [],
        "gates": [],
        "unmatched_threshold_cells": [],
        "notes": notes,
        "summary": {},
        "exit_code": None,
    }


class SuiteRun:
    """One run's state: the report being filled, the block results, the pollers running."""

    def __init__(self, cfg: SweepConfig, report: dict, output_dir: Path, thresholds: dict, log):
        self.cfg, self.report, self.output_dir, self.thresholds, self.log = cfg, report, output_dir, thresholds, log
        self.report_path = output_dir / REPORT_FILE
        self.cells_dir = output_dir / "cells"
        self.blocks: list[BlockResult] = []
        self.running: list[tuple[registry.BlockEntry, object]] = []

    def save(self) -> None:
        self.report["blocks"] = [b.to_dict() for b in self.blocks]
        write_json(self.report_path, self.report)

    def context(self, url: str, model: str, api_key: str | None) -> SuiteContext:
        ctx = SuiteContext(url, model, self.output_dir, self.cfg.path.parent, api_key, self.cfg.params, self.log)
        ctx.thresholds = self.thresholds  # for the blocks that gate themselves (accuracy, long-context)
        return ctx

    def run_blocks(self, chosen: list, ctx: SuiteContext) -> None:
        for entry, spec in chosen:
            self.log(f"block {entry.name}")
            self.blocks.append(registry.run_block(entry, spec, ctx))
            self.save()

    def start_during(self, chosen: list, ctx: SuiteContext) -> None:
        for entry, spec in chosen:
            start = registry.resolve(entry)
            if isinstance(start, BlockResult):  # not available
                self.blocks.append(start)
                continue
            try:
                self.running.append((entry, start(spec, ctx)))
            except Exception as exc:  # a poller that cannot start is that block's ERROR
                self.blocks.append(BlockResult(entry.name, "ERROR", f"{type(exc).__name__}: {exc}"))

    def stop_during(self) -> None:
        while self.running:
            entry, handle = self.running.pop(0)
            try:
                result = handle.stop()
            except Exception as exc:
                result = BlockResult(entry.name, "ERROR", f"{type(exc).__name__}: {exc}")
            result.block = entry.name
            self.blocks.append(result)
        self.save()

    def record_cell(self, cell, result: dict) -> None:
        self.report["cells"][cell.key] = result
        name = sw.cell_file_name(self.cfg.params["result_filename"], cell.key)
        write_json(self.cells_dir / name, result)
        self.save()


def run_suite(
    cfg: SweepConfig,
    base_url: str | None = None,
    output_dir: str | Path = ".",
    threshold_path: str | Path | None = None,
    enforce: bool | None = None,
    api_key: str | None = None,
    vocab_size: int | None = None,
    show_progress: bool = True,
    log: Callable[[str], None] = print,
) -> SuiteOutcome:
    output_dir = Path(output_dir)
    threshold_file = resolve_threshold_path(cfg, threshold_path)
    thresholds = load_thresholds(threshold_file, cfg.profile) if threshold_file else {}
    enforce = cfg.enforce_thresholds if enforce is None else enforce
    chosen, external, notes = preflight(cfg, base_url, thresholds, enforce, log)
    for note in notes:
        log(f"note: {note}")
    phase = {ph: [(e, s) for e, s in chosen if e.phase == ph] for ph in ("before", "during", "after")}

    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "cells").mkdir(exist_ok=True)
    run = SuiteRun(cfg, new_report(cfg, external, enforce, threshold_file, notes), output_dir, thresholds, log)
    run.save()

    def server():
        if external is None:
            return sw.launched_server(cfg, output_dir / sw.SERVER_LOG, log)
        sw.wait_until_serving(external, server_ready_timeout_s(cfg.params), api_key)
        return contextlib.nullcontext(external)

    # consecutive cells with one session key share a server (reuse_server_across_sweep)
    sessions = [list(g) for _, g in groupby(cfg.cells, key=lambda c: sw.session_key(cfg, c))]
    index = 0
    try:
        for si, session in enumerate(sessions):
            with server() as url:
                model = sw.served_model(url, cfg.model_id, api_key)
                run.report.update(base_url=url, model=model)
                ctx = run.context(url, model, api_key)
                if si == 0:
                    run.run_blocks(phase["before"], ctx)
                    run.start_during(phase["during"], ctx)
                for cell in session:
                    index += 1
                    log(f"[{index}/{len(cfg.cells)}] {cell.key} ({cell.combo}, {cell.num_prompts} prompts)")
                    bench_kw = dict(api_key=api_key, vocab_size=vocab_size, show_progress=show_progress)
                    run.record_cell(cell, sw.run_cell(cell, cfg, url, model, index, **bench_kw))
                if si == len(sessions) - 1:
                    run.stop_during()
                    run.run_blocks(phase["after"], ctx)
    finally:
        run.stop_during()  # a sweep that raised still stops its pollers
    rows = gate_cells(run.report["cells"], thresholds)
    rows += max_failed_rows(run.report["cells"], cfg.params["bench_max_failed_requests"])
    rows += block_gates(run.blocks, thresholds)
    code = suite_exit_code(rows, run.blocks, enforce)
    run.report.update(
        finished_at=_now(),
        gates=[r.to_dict() for r in rows],
        unmatched_threshold_cells=unmatched_threshold_cells(run.report["cells"], thresholds),
        summary=summarize(rows, run.blocks),
        exit_code=code,
    )
    run.save()
    return SuiteOutcome(run.report, rows, run.blocks, code, run.report_path)
