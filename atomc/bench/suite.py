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
    notes = list(cfg.notes) + check_thresholds(cfg, thresholds, enforce)
    try:
        chosen = registry.configured_blocks(cfg.blocks)
    except ValueError as exc:
        raise SweepConfigError(str(exc)) from None
    external = sw.external_base_url(cfg, base_url)
    if external is None:
        sw.check_can_launch(cfg)
    else:
        if not cfg.native:
            log(f"driver {cfg.driver}: atomc starts no {cfg.driver} server; using the one you started at {external}")
        if cfg.params["reuse_server_across_sweep"] is False:
            notes.append(
                "reuse_server_across_sweep=false has no effect with an external server: atomc restarts nothing"
            )
        if cfg.params["nnodes"] > 1:
            notes.append(f"multi-node run (nnodes={cfg.params['nnodes']}): the servers were started by the user")
    for key in thresholds:
        if not is_cell_key(key) and key not in {e.name for e, _ in chosen}:
            notes.append(f"threshold entry {key!r} gates no block of this run")
    for note in notes:
        log(f"note: {note}")

    output_dir.mkdir(parents=True, exist_ok=True)
    report_path = output_dir / REPORT_FILE
    p = cfg.params
    report: dict = {
        "schema": REPORT_SCHEMA,
        "started_at": _now(),
        "finished_at": None,
        "config": str(cfg.path),
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
        "topology": {
            k: p[k] for k in ("tensor_parallelism", "pipeline_parallel_size", "nnodes", "master_addr", "master_port")
        },
        "params": p,
        "enforce_thresholds": enforce,
        "threshold_file": str(threshold_file) if threshold_file else None,
        "cells": {},
        "blocks": [],
        "gates": [],
        "unmatched_threshold_cells": [],
        "notes": notes,
        "summary": {},
        "exit_code": None,
    }
    block_results: list[BlockResult] = []

    def save() -> None:
        report["blocks"] = [b.to_dict() for b in block_results]
        report_path.write_text(json.dumps(json_safe(report), indent=2) + "\n")

    def server(url: str | None):
        if url is None:
            return sw.launched_server(cfg, output_dir / sw.SERVER_LOG, log)
        sw.wait_until_serving(url, server_ready_timeout_s(p), api_key)
        return contextlib.nullcontext(url)

    by_phase = {ph: [(e, s) for e, s in chosen if e.phase == ph] for ph in ("before", "during", "after")}
    running: list[tuple[registry.BlockEntry, object]] = []

    def stop_during() -> None:
        while running:
            entry, handle = running.pop(0)
            try:
                result = handle.stop()
            except Exception as exc:
                result = BlockResult(entry.name, "ERROR", f"{type(exc).__name__}: {exc}")
            block_results.append(result)

    cells_dir = output_dir / "cells"
    cells_dir.mkdir(exist_ok=True)
    save()
    groups = [list(g) for _, g in groupby(cfg.cells, key=lambda c: sw.session_key(cfg, c))]
    index = 0
    try:
        for gi, group in enumerate(groups):
            with server(external) as url:
                model = sw.served_model(url, cfg.model_id, api_key)
                report.update(base_url=url, model=model)
                ctx = SuiteContext(url, model, output_dir, cfg.path.parent, api_key, p, log)
                # the whole threshold file, for blocks that gate themselves (accuracy, long-context)
                ctx.thresholds = thresholds
                if gi == 0:
                    for entry, spec in by_phase["before"]:
                        log(f"block {entry.name}")
                        block_results.append(registry.run_block(entry, spec, ctx))
                        save()
                    for entry, spec in by_phase["during"]:
                        fn = registry.resolve(entry)
                        if isinstance(fn, BlockResult):
                            block_results.append(fn)
                            continue
                        try:
                            running.append((entry, fn(spec, ctx)))
                        except Exception as exc:
                            block_results.append(BlockResult(entry.name, "ERROR", f"{type(exc).__name__}: {exc}"))
                for cell in group:
                    index += 1
                    log(f"[{index}/{len(cfg.cells)}] {cell.key} ({cell.combo}, {cell.num_prompts} prompts)")
                    result = sw.run_cell(
                        cell,
                        cfg,
                        url,
                        model,
                        index,
                        api_key=api_key,
                        vocab_size=vocab_size,
                        show_progress=show_progress,
                    )
                    report["cells"][cell.key] = result
                    (cells_dir / sw.cell_file_name(p["result_filename"], cell.key)).write_text(
                        json.dumps(json_safe(result), indent=2) + "\n"
                    )
                    save()
                if gi == len(groups) - 1:
                    stop_during()
                    save()
                    for entry, spec in by_phase["after"]:
                        log(f"block {entry.name}")
                        block_results.append(registry.run_block(entry, spec, ctx))
                        save()
    finally:
        stop_during()  # a sweep that raised still stops its pollers
    rows = gate_cells(report["cells"], thresholds)
    rows += max_failed_rows(report["cells"], p["bench_max_failed_requests"])
    rows += block_gates(block_results, thresholds)
    code = suite_exit_code(rows, block_results, enforce)
    report.update(
        finished_at=_now(),
        gates=[r.to_dict() for r in rows],
        unmatched_threshold_cells=unmatched_threshold_cells(report["cells"], thresholds),
        summary=summarize(rows, block_results),
        exit_code=code,
    )
    save()
    return SuiteOutcome(report, rows, block_results, code, report_path)
