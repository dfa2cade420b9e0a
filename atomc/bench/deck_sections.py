"""The run deck's HTML sections, each a function of the report: summary, gates, performance plots,
blocks, accuracy, long-context heat maps, platform samples and the comparison panels.

Plain HTML strings with every report value escaped; the plots are SVG from deck_svg.py, so the page
needs no script. deck.py puts the sections together into the page.
"""

from __future__ import annotations

import re
from html import escape

from atomc.bench.deck_panels import PARITY_METRICS, blocks_named
from atomc.bench.deck_panels import number as _num
from atomc.bench.deck_svg import line_chart

PERF_PLOTS = (  # (metric, title, y label)
    ("output_throughput", "Output throughput", "tok/s"),
    ("mean_ttft_ms", "Mean TTFT", "ms"),
    ("mean_tpot_ms", "Mean TPOT", "ms"),
)
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
    """The gated metrics (PASS / FAIL / SKIP) first; the metrics only recorded (INFO, most of a
    sweep's rows) in a folded table below them, so a failed gate is never hundreds of rows down."""
    gates = report.get("gates") or []
    if not gates:
        return section("Gates", "<p>No gates: the run had no threshold file.</p>", "gates")
    headers = ["cell", "metric", "kind", "threshold", "actual", "verdict", "reason"]

    def row(g: dict) -> list[str]:
        return [
            escape(str(g.get("cell"))),
            escape(str(g.get("metric"))),
            escape(str(g.get("kind"))),
            escape(str(g.get("threshold"))),
            fmt(g.get("actual")),
            badge(g.get("status", "?")),
            escape(str(g.get("reason", ""))),
        ]

    gated = [row(g) for g in gates if g.get("status") != "INFO"]
    recorded = [row(g) for g in gates if g.get("status") == "INFO"]
    body = table(headers, gated) if gated else "<p>No metric of this run is gated.</p>"
    if recorded:
        body += (
            f"<details><summary>{len(recorded)} metrics recorded, not gated</summary>"
            f"{table(headers, recorded)}</details>"
        )
    return section("Gates", body, "gates")


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
