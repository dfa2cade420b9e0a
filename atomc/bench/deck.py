"""The run deck: one self-contained HTML page per run, and the report JSON beside it.

Input is the run's report (the sweep's results JSON: `cells` {cell key: metrics}, `gates` [gate
rows], plus `blocks` [BlockResult.to_dict()] when the suite ran optional blocks). The page shows
every cell's gates, output throughput / TTFT / TPOT against concurrency for each shape, the
accuracy and long-context tables, the platform samples over time, and CVS's comparison panels
when their inputs are given:
  - `panels.prev_run`: per-cell output-throughput delta against a previous run's report, and
    `panels.accuracy_prev_run`: the accuracy metrics' deltas (CVS_INFERENCE_PREV_REPORT_JSON);
  - `panels.framework_parity`: per-cell ratios to another framework's report of the same cells,
    e.g. vLLM's, measured with `--base-url` (CVS_ATOM_PARITY_REF_JSON).
The panels are computed (deck_panels.py) and written into the JSON (`panels`), so a script can
read the same numbers the page shows. They only render: they never change a gate or the exit code.

The page carries no script and loads nothing: its plots are SVG drawn by deck_svg.py. This module
puts the page together (render_html, from deck_sections.py's sections) and writes it with its
JSON (write_deck).
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

from atomc import env
from atomc.bench.deck_panels import comparison_panels, load_json, parity_panel, prev_run_panel
from atomc.bench.deck_sections import (
    accuracy_section,
    blocks_section,
    gates_section,
    long_context_section,
    panels_section,
    perf_section,
    platform_section,
    summary_section,
)

__all__ = ["HTML_FILE", "JSON_FILE", "comparison_panels", "parity_panel", "prev_run_panel", "render_html", "write_deck"]

HTML_FILE = "run_deck.html"
JSON_FILE = "run_deck.json"


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;background:#fafafa}
h1{font-size:22px;margin:0 0 12px} h2{font-size:18px;border-bottom:1px solid #ccc;padding-bottom:4px;margin-top:28px}
h3{font-size:15px;margin:16px 0 6px}
table{border-collapse:collapse;margin:8px 0;font-size:13px;background:#fff}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top} th{background:#f0f0f0}
table.kv td:first-child{font-weight:600}
.badge{display:inline-block;padding:1px 6px;border-radius:3px;font-size:12px;font-weight:600;color:#fff;background:#888}
.badge.pass{background:#2ca02c}.badge.fail{background:#d62728}.badge.error{background:#8b0000}
.badge.skip{background:#999}.badge.info{background:#1f77b4}
.charts{display:flex;flex-wrap:wrap;gap:12px}
svg.chart{background:#fff;border:1px solid #ddd}
svg .title{font-size:13px;font-weight:600} svg .tick,svg .legend{font-size:11px;fill:#444} svg .label{font-size:12px}
svg .grid{stroke:#eee} svg .axis{stroke:#666}
td.heat{text-align:center;color:#fff;font-weight:600;min-width:44px}
.up{color:#2ca02c}.down{color:#d62728} .note{font-size:12px;color:#555}
"""


def render_html(report: dict, panels: dict | None = None, overlays: dict[str, dict] | None = None) -> str:
    panels = panels if panels is not None else report.get("panels") or {}
    title = f"atomc run deck: {report.get('model') or 'run'}"
    body = "".join(
        [
            summary_section(report),
            gates_section(report),
            perf_section(report, overlays),
            blocks_section(report),
            accuracy_section(report),
            long_context_section(report),
            platform_section(report),
            panels_section(panels),
        ]
    )
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f"<style>{CSS}</style></head><body><h1>{escape(title)}</h1>{body}</body></html>\n"
    )


def write_deck(
    report: dict,
    out_dir: str | Path,
    prev_path: str | Path | None = None,
    parity_path: str | Path | None = None,
) -> tuple[Path, Path]:
    """Write run_deck.html and run_deck.json (the report plus its `panels`) into `out_dir`.
    The comparison inputs default to $CVS_INFERENCE_PREV_REPORT_JSON and $CVS_ATOM_PARITY_REF_JSON."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prev_path = Path(prev_path) if prev_path else env.prev_report_json()
    parity_path = Path(parity_path) if parity_path else env.parity_ref_json()
    prev = load_json(prev_path, "previous report")
    parity = load_json(parity_path, "parity reference")
    panels = comparison_panels(report, prev, parity, parity_path.stem if parity_path else "")
    full = {**report, "panels": panels}
    if prev_path:
        full["panels_inputs"] = {"prev_report": str(prev_path)}
    if parity_path:
        full.setdefault("panels_inputs", {})["parity_ref"] = str(parity_path)
    json_path, html_path = out_dir / JSON_FILE, out_dir / HTML_FILE
    json_path.write_text(json.dumps(full, indent=2, default=str) + "\n")
    overlays = {}
    if prev is not None:
        overlays["previous run"] = prev
    if parity is not None:
        overlays[str(panels["framework_parity"]["reference"])] = parity
    html_path.write_text(render_html(full, panels, overlays))
    return html_path, json_path
