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
The panels are computed here and written into the JSON (`panels`), so a script can read the same
numbers the page shows. They only render: they never change a gate or the exit code.

The page carries no script and loads nothing: its plots are SVG drawn by deck_svg.py.
"""

from __future__ import annotations

import json
import re
from html import escape
from pathlib import Path

from atomc import env
from atomc.bench.deck_svg import line_chart

HTML_FILE = "run_deck.html"
JSON_FILE = "run_deck.json"
PERF_PLOTS = (  # (metric, title, y label)
    ("output_throughput", "Output throughput", "tok/s"),
    ("mean_ttft_ms", "Mean TTFT", "ms"),
    ("mean_tpot_ms", "Mean TPOT", "ms"),
)
PARITY_METRICS = ("output_throughput", "mean_ttft_ms", "mean_tpot_ms")
_KEY = re.compile(r"(\w+)=([^,]+)")


def parse_cell_key(key: str) -> dict[str, str]:
    """`ISL=1024,OSL=1024,TP=8,PP=1,CONC=64` -> {"ISL": "1024", ...}."""
    return dict(_KEY.findall(key))


def shape_of(key: str, cell: dict) -> tuple[str, int | None]:
    """(shape label, concurrency) of a cell: the shape is everything in the key but CONC."""
    parts = parse_cell_key(key)
    conc = parts.pop("CONC", None)
    label = ",".join(f"{k}={v}" for k, v in parts.items())
    if cell.get("combo"):
        label = f"{cell['combo']} ({label})"
    try:
        return label, int(conc) if conc is not None else cell.get("max_concurrency")
    except ValueError:
        return label, None


def _num(x) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None


def blocks_named(report: dict, prefix: str) -> list[dict]:
    return [b for b in report.get("blocks") or [] if str(b.get("block", "")).startswith(prefix)]


def accuracy_metrics(report: dict) -> dict[str, float]:
    """Every accuracy figure of a report, by `task id/metric` (and NIAH's pass rates)."""
    out: dict[str, float] = {}
    for block in blocks_named(report, "accuracy") + blocks_named(report, "long_context_accuracy"):
        out.update({k: v for k, v in (block.get("metrics") or {}).items() if _num(v) is not None})
    return out


# --- comparison panels -------------------------------------------------------------------------


def prev_run_panel(report: dict, prev: dict) -> list[dict]:
    rows = []
    for key, cell in (report.get("cells") or {}).items():
        now, before = (
            _num(cell.get("output_throughput")),
            _num(((prev.get("cells") or {}).get(key) or {}).get("output_throughput")),
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
            a, b = _num(cell.get(m)), _num(other.get(m))
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


# --- the page ----------------------------------------------------------------------------------


def fmt(v, digits: int = 2) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:.{digits}f}" if abs(v) < 1e6 else f"{v:.4g}"
    return escape(str(v))


def badge(status: str) -> str:
    s = escape(str(status))
    return f'<span class="badge {s.lower()}">{s}</span>'


def table(headers: list[str], rows: list[list[str]], cls: str = "") -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    thead = f"<thead><tr>{head}</tr></thead>" if any(headers) else ""
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}">{thead}<tbody>{body}</tbody></table>'


def section(title: str, body: str, sid: str) -> str:
    return f'<section id="{sid}"><h2>{escape(title)}</h2>{body}</section>'


def summary_section(report: dict) -> str:
    gates = report.get("gates") or []
    counts = {s: sum(g.get("status") == s for g in gates) for s in ("PASS", "FAIL", "SKIP", "INFO")}
    blocks = report.get("blocks") or []
    profile = f" (profile {fmt(report['profile'])})" if report.get("profile") else ""
    items = [
        ("model", fmt(report.get("model"))),
        ("server", fmt(report.get("base_url"))),
        ("config", fmt(report.get("config")) + profile),
        *((k.replace("_", " "), fmt(report[k])) for k in ("driver", "started_at", "finished_at") if report.get(k)),
        ("thresholds", fmt(report.get("threshold_file"))),
        ("mode", "enforced" if report.get("enforce_thresholds") else "record-only"),
        ("gates", " ".join(f"{badge(s)} {n}" for s, n in counts.items())),
        ("blocks", " ".join(f"{escape(b.get('block', '?'))} {badge(b.get('verdict', '?'))}" for b in blocks) or "none"),
        ("exit code", fmt(report.get("exit_code"))),
    ]
    return section("Summary", table(["", ""], [[escape(k), v] for k, v in items], "kv"), "summary")


def gates_section(report: dict) -> str:
    gates = report.get("gates") or []
    if not gates:
        return section("Gates", "<p>No gates: the run had no threshold file.</p>", "gates")
    rows = [
        [
            escape(str(g.get("cell"))),
            escape(str(g.get("metric"))),
            escape(str(g.get("kind"))),
            escape(str(g.get("threshold"))),
            fmt(g.get("actual")),
            badge(g.get("status", "?")),
            escape(str(g.get("reason", ""))),
        ]
        for g in gates
    ]
    return section(
        "Gates", table(["cell", "metric", "kind", "threshold", "actual", "verdict", "reason"], rows), "gates"
    )


def shape_key(key: str) -> str:
    """The shape part of a cell key (all but CONC): how cells of two reports are matched."""
    return ",".join(f"{k}={v}" for k, v in parse_cell_key(key).items() if k != "CONC")


def by_shape(cells: dict) -> dict[str, list[tuple[int, dict]]]:
    out: dict[str, list[tuple[int, dict]]] = {}
    for key, cell in cells.items():
        conc = parse_cell_key(key).get("CONC")
        if conc is not None and conc.isdigit():
            out.setdefault(shape_key(key), []).append((int(conc), cell))
    return out


def perf_section(report: dict, overlays: dict[str, dict] | None = None) -> str:
    """Per shape, each metric against concurrency; `overlays` ({label: report}) add the same
    shape's cells of other runs (the previous run, the parity reference) as more lines."""
    cells = report.get("cells") or {}
    if not cells:
        return section("Performance", "<p>No sweep cells.</p>", "perf")
    shapes = by_shape(cells)
    others = {label: by_shape(r.get("cells") or {}) for label, r in (overlays or {}).items()}
    parts = []
    for shape, points in shapes.items():
        combo = next((c.get("combo") for _, c in points if c.get("combo")), None)
        label = f"{combo} ({shape})" if combo else shape
        charts = []
        for metric, title, unit in PERF_PLOTS:
            series = [("this run" if others else metric, [(c, _num(cell.get(metric))) for c, cell in points])]
            for name, other in others.items():
                if other.get(shape):
                    series.append((name, [(c, _num(cell.get(metric))) for c, cell in other[shape]]))
            charts.append(line_chart(series, title, "concurrency", unit, log2_x=True))
        parts.append(f'<div class="shape"><h3>{escape(label)}</h3><div class="charts">{"".join(charts)}</div></div>')
    headers = ["cell", "ok/total", "out tok/s", "mean TTFT ms", "p99 TTFT ms", "mean TPOT ms", "mean ITL ms"]
    rows = [
        [
            escape(k),
            f"{fmt(c.get('completed'))}/{fmt(c.get('num_prompts'))}",
            fmt(c.get("output_throughput")),
            fmt(c.get("mean_ttft_ms")),
            fmt(c.get("p99_ttft_ms")),
            fmt(c.get("mean_tpot_ms")),
            fmt(c.get("mean_itl_ms")),
        ]
        for k, c in cells.items()
    ]
    return section("Performance", "".join(parts) + table(headers, rows), "perf")


def blocks_section(report: dict) -> str:
    blocks = report.get("blocks") or []
    if not blocks:
        return ""
    rows = [
        [escape(str(b.get("block"))), badge(b.get("verdict", "?")), escape(str(b.get("reason", "")))] for b in blocks
    ]
    return section("Blocks", table(["block", "verdict", "reason"], rows), "blocks")


def accuracy_section(report: dict) -> str:
    rows = []
    for block in blocks_named(report, "accuracy"):
        for task in block.get("rows") or []:
            metrics = task.get("metrics") or {}
            gates = {g["metric"]: g for g in task.get("gates") or [] if g.get("metric") != "-"}
            shown = [m for m in metrics if "_stderr" not in m and not m.endswith(".sample_len")]
            for m in shown or ["-"]:
                stderr = metrics.get(m.replace(".exact_match", ".exact_match_stderr")) if "exact_match" in m else None
                value = fmt(metrics.get(m), 4) + (f" ± {stderr:.4f}" if stderr is not None else "")
                g = gates.get(m)
                rows.append(
                    [
                        escape(task.get("id", "?")),
                        escape(",".join(task.get("tasks") or [])),
                        escape(m),
                        value,
                        escape(g["threshold"]) if g else "-",
                        badge(g["status"] if g else "INFO"),
                        escape(g["reason"] if g else task.get("error") or "recorded, not gated"),
                    ]
                )
            for name, g in gates.items():
                if name not in metrics:
                    rows.append(
                        [
                            escape(task.get("id", "?")),
                            escape(",".join(task.get("tasks") or [])),
                            escape(name),
                            "n/a",
                            escape(g["threshold"]),
                            badge(g["status"]),
                            escape(g["reason"]),
                        ]
                    )
    if not rows:
        return ""
    headers = ["task id", "lm-eval tasks", "metric", "value", "threshold", "verdict", "reason"]
    return section("Accuracy", table(headers, rows), "accuracy")


def _heat(rate: float | None) -> str:
    if rate is None:
        return "#eee"
    # red (0) through amber (0.5) to green (1)
    stops = [(214, 39, 40), (230, 160, 30), (44, 160, 44)]
    lo, f = (0, rate * 2) if rate <= 0.5 else (1, rate * 2 - 1)
    c = [round(a + (b - a) * f) for a, b in zip(stops[lo], stops[lo + 1], strict=True)]
    return f"rgb({c[0]},{c[1]},{c[2]})"


def long_context_section(report: dict) -> str:
    parts = []
    summary = []
    for block in blocks_named(report, "long_context_accuracy"):
        for cell in block.get("rows") or []:
            gate = next((g for g in cell.get("gates") or []), None)
            summary.append(
                [
                    escape(cell.get("id", "?")),
                    fmt(cell.get("pass_rate"), 3),
                    fmt(cell.get("prompts")),
                    escape(str(cell.get("length_source", ""))),
                    escape(gate["threshold"]) if gate else "-",
                    badge(cell.get("status", "?")),
                    escape(str(cell.get("reason", ""))),
                ]
            )
            grid = [g for g in cell.get("grid") or [] if "pass_rate" in g]
            if not grid:
                continue
            lengths = sorted({g["length"] for g in grid})
            depths = sorted({g["depth"] for g in grid})
            by = {(g["length"], g["depth"]): g for g in grid}
            head = "<tr><th>length \\ depth</th>" + "".join(f"<th>{d:.0%}</th>" for d in depths) + "</tr>"
            body = ""
            for n in lengths:
                tokens = next((by[n, d].get("prompt_tokens") for d in depths if (n, d) in by), None)
                body += f"<tr><th>{n} <small>({fmt(tokens)} sent)</small></th>"
                for d in depths:
                    g = by.get((n, d))
                    rate = g["pass_rate"] if g else None
                    label = f"{g['retrieved']}/{g['prompts']}" if g else ""
                    body += f'<td class="heat" style="background:{_heat(rate)}">{label}</td>'
                body += "</tr>"
            parts.append(f'<h3>{escape(cell["id"])}</h3><table class="heatmap">{head}{body}</table>')
    if not summary:
        return ""
    headers = ["cell", "pass rate", "prompts", "tokens counted by", "threshold", "verdict", "reason"]
    return section("Long-context accuracy (NIAH, ACC-12)", table(headers, summary) + "".join(parts), "long_context")


def platform_section(report: dict) -> str:
    charts = []
    for block in report.get("blocks") or []:
        samples = [s for s in block.get("samples") or [] if _num(s.get("t")) is not None]
        if not samples:
            continue
        keys = sorted(
            {k for s in samples for k, v in s.items() if k not in ("t", "gpu", "device") and _num(v) is not None}
        )
        for key in keys:
            groups: dict[str, list[tuple[float, float]]] = {}
            for s in samples:
                if _num(s.get(key)) is not None:
                    name = f"gpu {s['gpu']}" if "gpu" in s else key
                    groups.setdefault(name, []).append((float(s["t"]), float(s[key])))
            charts.append(line_chart(sorted(groups.items()), key, "time (s)", key))
    if not charts:
        return ""
    return section("Platform samples", f'<div class="charts">{"".join(charts)}</div>', "platform")


def panels_section(panels: dict) -> str:
    out = []
    if "prev_run" in panels:
        rows = [
            [
                escape(r["cell"]),
                fmt(r["prev_output_throughput"]),
                fmt(r["output_throughput"]),
                fmt(r["delta"]),
                _delta(r["delta_pct"], "%"),
            ]
            for r in panels["prev_run"]
        ]
        out.append(
            "<h3>Throughput against the previous run</h3>"
            + table(["cell", "previous tok/s", "this run tok/s", "delta", "delta %"], rows)
        )
    if panels.get("accuracy_prev_run"):
        rows = [
            [escape(r["metric"]), fmt(r["prev_value"], 4), fmt(r["value"], 4), _delta(r["delta"], "", 4)]
            for r in panels["accuracy_prev_run"]
        ]
        out.append(
            "<h3>Accuracy against the previous run</h3>" + table(["metric", "previous", "this run", "delta"], rows)
        )
    if "framework_parity" in panels:
        p = panels["framework_parity"]
        rows = [
            [escape(r["cell"])]
            + [f"{fmt(r[m])} / {fmt(r[f'ref_{m}'])} = <b>{fmt(r[f'{m}_ratio'], 3)}</b>" for m in PARITY_METRICS]
            for r in p["rows"]
        ]
        out.append(
            f"<h3>Framework parity: atomc / {escape(str(p['reference']))}</h3>"
            + table(["cell", *PARITY_METRICS], rows)
            + '<p class="note">Throughput above 1 and latencies below 1 mean atomc is ahead.</p>'
        )
    if not out:
        return ""
    return section("Comparison (render only: no effect on gates)", "".join(out), "panels")


def _delta(v: float | None, unit: str, digits: int = 1) -> str:
    if v is None:
        return "n/a"
    cls = "up" if v > 0 else "down" if v < 0 else ""
    return f'<span class="{cls}">{v:+.{digits}f}{unit}</span>'


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
