"""The run deck's comparison panels: this run against a previous run and against another framework.

CVS's render-only panels, computed from two reports (the inputs are files: a previous run's report,
CVS_INFERENCE_PREV_REPORT_JSON; another framework's report of the same cells, measured with
`--base-url`, CVS_ATOM_PARITY_REF_JSON):
  - `prev_run`: per-cell output-throughput delta, and `accuracy_prev_run`: the accuracy metrics' deltas;
  - `framework_parity`: per-cell ratios of throughput and latencies.
They are plain rows, written into the deck's JSON (`panels`) so a script reads the numbers the page
shows (deck_sections.py renders them); they never change a gate or the exit code.
"""

from __future__ import annotations

import json
from pathlib import Path

PARITY_METRICS = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms")


def number(x) -> float | None:
    """A report value as a float, or None for anything that is not a number (bools included)."""
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None


def blocks_named(report: dict, prefix: str) -> list[dict]:
    return [b for b in report.get("blocks") or [] if str(b.get("block", "")).startswith(prefix)]


def accuracy_metrics(report: dict) -> dict[str, float]:
    """Every accuracy figure of a report, by `task id/metric` (and NIAH's pass rates)."""
    out: dict[str, float] = {}
    for block in blocks_named(report, "accuracy") + blocks_named(report, "long_context_accuracy"):
        out.update({k: v for k, v in (block.get("metrics") or {}).items() if number(v) is not None})
    return out


def prev_run_panel(report: dict, prev: dict) -> list[dict]:
    rows = []
    for key, cell in (report.get("cells") or {}).items():
        now, before = (
            number(cell.get("output_throughput")),
            number(((prev.get("cells") or {}).get(key) or {}).get("output_throughput")),
        )
        row = {
            "cell": key,
            "output_throughput": now,
            "prev_output_throughput": before,
            "delta": None,
            "delta_pct": None,
        }
        if now is not None and before is not None:
            row["delta"] = now - before
            row["delta_pct"] = (now - before) / before * 100 if before else None
        rows.append(row)
    return rows


def accuracy_prev_panel(report: dict, prev: dict) -> list[dict]:
    now, before = accuracy_metrics(report), accuracy_metrics(prev)
    rows = []
    for name in sorted(set(now) | set(before)):
        if "_stderr" in name or name.endswith(".sample_len"):
            continue
        a, b = now.get(name), before.get(name)
        rows.append(
            {"metric": name, "value": a, "prev_value": b, "delta": a - b if a is not None and b is not None else None}
        )
    return rows


def parity_panel(report: dict, ref: dict) -> list[dict]:
    """atomc / reference for each metric of each shared cell. Throughput: above 1 is atomc ahead;
    latencies: below 1 is atomc ahead."""
    rows = []
    ref_cells = ref.get("cells") or {}
    for key, cell in (report.get("cells") or {}).items():
        other = ref_cells.get(key)
        if other is None:
            continue
        row: dict = {"cell": key}
        for m in PARITY_METRICS:
            a, b = number(cell.get(m)), number(other.get(m))
            row[m] = a
            row[f"ref_{m}"] = b
            row[f"{m}_ratio"] = a / b if a is not None and b else None
        rows.append(row)
    return rows


def load_json(path: Path | None, what: str) -> dict | None:
    if path is None:
        return None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {what} {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path} is not a JSON object")
    return data


def comparison_panels(report: dict, prev: dict | None, parity: dict | None, parity_label: str = "") -> dict:
    panels: dict = {}
    if prev is not None:
        panels["prev_run"] = prev_run_panel(report, prev)
        panels["accuracy_prev_run"] = accuracy_prev_panel(report, prev)
    if parity is not None:
        label = parity.get("framework") or parity.get("base_url") or parity_label or "reference"
        panels["framework_parity"] = {"reference": label, "rows": parity_panel(report, parity)}
    return panels
