"""Small static SVG line charts for the run deck, drawn in Python at build time.

The deck must open offline and on its own, so it carries its plots inside the page: SVG drawn
here needs no script and no plotting library (a vendored JS library would be tens of kilobytes
for what is a few lines and dots). Each data point is a `<circle class="pt">` with `data-x`,
`data-y` and a `<title>` (the browser's tooltip), so a test, or a person, can read values back.
"""

from __future__ import annotations

import math
from html import escape

WIDTH, HEIGHT = 420, 260
MARGIN = {"left": 64, "right": 16, "top": 30, "bottom": 44}
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"]


def fmt_num(v: float) -> str:
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.3g}M"
    if a >= 1e4:
        return f"{v / 1e3:.3g}k"
    if a >= 100:
        return f"{v:.0f}"
    return f"{v:.3g}"


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    # from the last tick at or below `lo` to the first at or above `hi`: the data stays inside
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(i * step, 12) for i in range(first, last + 1)]


def line_chart(
    series: list[tuple[str, list[tuple[float, float]]]],
    title: str,
    x_label: str,
    y_label: str,
    log2_x: bool = False,
) -> str:
    """One chart: each series a polyline with a dot per point; `log2_x` spaces x as log2 (for
    concurrency 1, 2, 4, ... 128) and labels the ticks with the values themselves."""
    points = [(x, y) for _, pts in series for x, y in pts if y is not None and math.isfinite(y)]
    if not points:
        text = f'<text x="8" y="30">{escape(title)}: no data</text>'
        return f'<svg class="chart empty" width="{WIDTH}" height="60">{text}</svg>'
    tx = (lambda x: math.log2(x)) if log2_x else (lambda x: x)
    xs = [tx(x) for x, _ in points]
    x_lo, x_hi = min(xs), max(xs)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    y_ticks = nice_ticks(min(0.0, min(y for _, y in points)), max(y for _, y in points))
    y_lo, y_hi = y_ticks[0], y_ticks[-1]
    pw, ph = WIDTH - MARGIN["left"] - MARGIN["right"], HEIGHT - MARGIN["top"] - MARGIN["bottom"]
    # the legend goes under the plot, a row per three series, so it never covers a point
    legend_rows = math.ceil(len(series) / 3) if len(series) > 1 else 0
    height = HEIGHT + 16 * legend_rows

    def px(x: float) -> float:
        return MARGIN["left"] + (tx(x) - x_lo) / (x_hi - x_lo) * pw

    def py(y: float) -> float:
        return MARGIN["top"] + ph - (y - y_lo) / (y_hi - y_lo) * ph

    out = [
        f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{escape(title)}">',
        f'<text class="title" x="{WIDTH / 2}" y="18" text-anchor="middle">{escape(title)}</text>',
    ]
    for t in y_ticks:
        y = py(t)
        out.append(
            f'<line class="grid" x1="{MARGIN["left"]}" x2="{WIDTH - MARGIN["right"]}" y1="{y:.1f}" y2="{y:.1f}"/>'
        )
        out.append(f'<text class="tick" x="{MARGIN["left"] - 6}" y="{y + 4:.1f}" text-anchor="end">{fmt_num(t)}</text>')
    x_values = sorted({x for x, _ in points})
    if log2_x or len(x_values) <= 10:
        x_ticks = x_values
    else:
        x_ticks = [t for t in nice_ticks(min(x_values), max(x_values)) if min(x_values) <= t <= max(x_values)]
    for t in x_ticks:
        x = px(t)
        out.append(
            f'<line class="axis" x1="{x:.1f}" x2="{x:.1f}" y1="{MARGIN["top"] + ph}" y2="{MARGIN["top"] + ph + 4}"/>'
        )
        out.append(
            f'<text class="tick" x="{x:.1f}" y="{MARGIN["top"] + ph + 16}" text-anchor="middle">{fmt_num(t)}</text>'
        )
    out.append(
        f'<line class="axis" x1="{MARGIN["left"]}" x2="{WIDTH - MARGIN["right"]}" '
        f'y1="{MARGIN["top"] + ph}" y2="{MARGIN["top"] + ph}"/>'
    )
    out.append(
        f'<line class="axis" x1="{MARGIN["left"]}" x2="{MARGIN["left"]}" '
        f'y1="{MARGIN["top"]}" y2="{MARGIN["top"] + ph}"/>'
    )
    out.append(
        f'<text class="label" x="{MARGIN["left"] + pw / 2}" y="{HEIGHT - 8}" '
        f'text-anchor="middle">{escape(x_label)}</text>'
    )
    out.append(
        f'<text class="label" transform="translate(14 {MARGIN["top"] + ph / 2}) rotate(-90)" '
        f'text-anchor="middle">{escape(y_label)}</text>'
    )
    for i, (name, pts) in enumerate(series):
        color = COLORS[i % len(COLORS)]
        pts = sorted((x, y) for x, y in pts if y is not None and math.isfinite(y))
        if len(pts) > 1:
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
            out.append(f'<polyline class="line" fill="none" stroke="{color}" stroke-width="2" points="{path}"/>')
        for x, y in pts:
            out.append(
                f'<circle class="pt" cx="{px(x):.1f}" cy="{py(y):.1f}" r="3.5" fill="{color}" '
                f'data-series="{escape(name)}" data-x="{x:g}" data-y="{y:g}">'
                f"<title>{escape(name)}: {x:g} → {y:.4g}</title></circle>"
            )
        if len(series) > 1:
            lx, ly = MARGIN["left"] + (i % 3) * 130, HEIGHT - 2 + (i // 3) * 16
            out.append(
                f'<rect x="{lx}" y="{ly}" width="10" height="10" fill="{color}"/>'
                f'<text class="legend" x="{lx + 14}" y="{ly + 9}">{escape(name)}</text>'
            )
    out.append("</svg>")
    return "\n".join(out)
