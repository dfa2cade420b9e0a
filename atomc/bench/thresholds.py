"""Gate benchmark metrics against a CVS-style threshold file.

A threshold file maps a cell key (`ISL=..,OSL=..,TP=..,PP=..,CONC=..`) to `{metric: spec}`;
`spec["kind"]` says how the metric is judged. `evaluate` is the whole rule for one metric."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from enum import StrEnum

from atomc.bench.metrics import format_value, is_known_metric


class Status(StrEnum):
    PASS = "PASS"
    FAIL = "FAIL"
    SKIP = "SKIP"
    INFO = "INFO"


@dataclass(frozen=True)
class Verdict:
    status: Status
    reason: str


# kind -> (comparison shown in reasons, passes(actual, bound))
_BOUNDS = {
    "min": (">=", lambda a, v: a >= v),
    "min_tok_s": (">=", lambda a, v: a >= v),
    "max": ("<=", lambda a, v: a <= v),
    "max_ms": ("<=", lambda a, v: a <= v),
}
KINDS = (*_BOUNDS, "within", "min_ratio", "info")


def _number(x) -> float | None:
    # bools are ints in Python, but `true` as a threshold is a config mistake, not 1
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x)


def _fmt(x: float) -> str:
    if x == int(x) and abs(x) < 1e15:
        return str(int(x))
    if abs(x) < 0.01:
        return f"{x:.3g}"
    return f"{x:.3f}".rstrip("0").rstrip(".")


def resolve_reference(spec: dict, reference: dict | None) -> float | Verdict:
    """The reference value for `within`/`min_ratio`: a literal `reference` number or the value of
    `ref_metric` in `reference` (the cell's results). A Verdict when there is none to compare to."""
    if "reference" in spec:
        value = _number(spec["reference"])
        return value if value is not None else Verdict(Status.FAIL, "'reference' must be a number")
    if "ref_metric" in spec:
        name = spec["ref_metric"]
        value = _number((reference or {}).get(name))
        # a reference the run did not produce is skipped like any other missing metric
        return value if value is not None else Verdict(Status.SKIP, f"reference metric {name!r} missing")
    return Verdict(Status.FAIL, "spec needs 'reference' (a number) or 'ref_metric'")


def _evaluate_within(spec: dict, actual: float, ref: float) -> Verdict:
    if "tolerance" in spec:
        tol = _number(spec["tolerance"])
    elif "tolerance_pct" in spec:
        pct = _number(spec["tolerance_pct"])
        tol = None if pct is None else abs(ref) * pct / 100.0
    else:
        return Verdict(Status.FAIL, "within needs 'tolerance' or 'tolerance_pct'")
    if tol is None:
        return Verdict(Status.FAIL, "tolerance must be a number")
    diff = abs(actual - ref)
    ok = diff <= tol
    return Verdict(Status.PASS if ok else Status.FAIL,
                   f"|{_fmt(actual)} - {_fmt(ref)}| = {_fmt(diff)} {'<=' if ok else '>'} {_fmt(tol)}")


def _evaluate_min_ratio(value: float, actual: float, ref: float) -> Verdict:
    if ref == 0:
        return Verdict(Status.FAIL, "reference is 0; a ratio to it is undefined")
    ratio = actual / ref
    ok = ratio >= value
    return Verdict(Status.PASS if ok else Status.FAIL,
                   f"{_fmt(actual)} / {_fmt(ref)} = {_fmt(ratio)} {'>=' if ok else '<'} {_fmt(value)}")


def evaluate(spec: dict, actual: float | None, reference: dict | None = None) -> Verdict:
    """Judge one metric. Config errors (unknown kind, missing value) FAIL so they cannot pass
    silently; a metric the run did not produce is SKIPped, as CVS does at gate time."""
    if not isinstance(spec, dict):
        return Verdict(Status.FAIL, f"spec must be an object, got {spec!r}")
    kind = spec.get("kind")
    if kind not in KINDS:
        return Verdict(Status.FAIL, f"unknown threshold kind {kind!r} (known: {', '.join(KINDS)})")
    if kind == "info":
        return Verdict(Status.INFO, "recorded, not gated")
    if actual is None:
        return Verdict(Status.SKIP, "metric missing from results")
    actual_num = _number(actual)
    if actual_num is None or math.isnan(actual_num):
        return Verdict(Status.FAIL, f"actual value {actual!r} is not a number")
    if kind == "within":
        ref = resolve_reference(spec, reference)
        if isinstance(ref, Verdict):
            return ref
        return _evaluate_within(spec, actual_num, ref)
    value = _number(spec.get("value"))
    if value is None:
        return Verdict(Status.FAIL, f"{kind} needs a numeric 'value'")
    if kind == "min_ratio":
        ref = resolve_reference(spec, reference)
        if isinstance(ref, Verdict):
            return ref
        return _evaluate_min_ratio(value, actual_num, ref)
    op, passes = _BOUNDS[kind]
    if passes(actual_num, value):
        return Verdict(Status.PASS, f"{_fmt(actual_num)} {op} {_fmt(value)}")
    return Verdict(Status.FAIL, f"{_fmt(actual_num)} not {op} {_fmt(value)}")


def describe_threshold(spec) -> str:
    """A short human form of a spec for the gate table."""
    if not isinstance(spec, dict):
        return repr(spec)
    kind = spec.get("kind")
    if kind in _BOUNDS:
        return f"{_BOUNDS[kind][0]} {spec.get('value')}"
    ref = spec.get("reference", spec.get("ref_metric"))
    if kind == "within":
        tol = spec["tolerance"] if "tolerance" in spec else f"{spec.get('tolerance_pct')}%"
        return f"{ref} ± {tol}"
    if kind == "min_ratio":
        return f"/ {ref} >= {spec.get('value')}"
    return "-"


@dataclass(frozen=True)
class GateRow:
    cell: str
    metric: str
    kind: str
    threshold: str
    actual: float | None
    status: Status
    reason: str

    def to_dict(self) -> dict:
        return {**asdict(self), "status": str(self.status)}


def is_cell_key(key: str) -> bool:
    # threshold files also hold non-sweep blocks (accuracy, mtp_quality, ...) and `_comment` keys
    return key.startswith("ISL=")


def gate_cell(cell: str, metrics: dict, specs: dict) -> list[GateRow]:
    """One row per gated metric of a cell."""
    rows = []
    for metric, spec in specs.items():
        if metric.startswith("_"):
            continue
        kind = str(spec.get("kind")) if isinstance(spec, dict) else "?"
        actual = metrics.get(metric)
        if metric not in metrics and not is_known_metric(metric):
            verdict = Verdict(Status.FAIL, f"unknown metric {metric!r}: atomc bench never produces it")
        else:
            verdict = evaluate(spec, actual, metrics)
        threshold = describe_threshold(spec)
        rows.append(GateRow(cell, metric, kind, threshold, actual, verdict.status, verdict.reason))
    return rows


def gate_cells(cells: dict[str, dict], thresholds: dict) -> list[GateRow]:
    """Gate every cell's metrics. A cell absent from the threshold file gets one SKIP row saying
    so: it is reported, never a failure (new cells are recorded until someone calibrates them)."""
    rows: list[GateRow] = []
    for cell, metrics in cells.items():
        specs = thresholds.get(cell)
        if not isinstance(specs, dict):
            rows.append(GateRow(cell, "-", "-", "-", None, Status.SKIP, "no thresholds for cell"))
            continue
        rows.extend(gate_cell(cell, metrics, specs))
    return rows


def unmatched_threshold_cells(cells: dict[str, dict], thresholds: dict) -> list[str]:
    """Threshold cell keys no run produced: usually a typo in a key or a dropped run."""
    return sorted(k for k in thresholds if is_cell_key(k) and k not in cells)


def exit_code(rows: list[GateRow], enforce: bool) -> int:
    """1 when enforcing and any gate failed; record-only runs always exit 0."""
    return 1 if enforce and any(r.status is Status.FAIL for r in rows) else 0


# The page's rule: with enforce_thresholds, every gated cell (a sweep cell the threshold file has
# an entry for) needs a spec for each of these. vLLM's perf + health set (the whole latency
# distribution; itl has no p90) and the per-GPU throughputs of the ATOM suite.
GATED_METRICS = (
    "total_token_throughput", "output_throughput", "per_gpu_throughput", "output_tput_per_gpu",
    "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p95_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "p90_tpot_ms", "p95_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "p95_itl_ms", "p99_itl_ms",
    "mean_e2el_ms", "median_e2el_ms", "p90_e2el_ms", "p95_e2el_ms", "p99_e2el_ms",
    "success_rate", "failed",
)  # fmt: skip
SCALING_METRIC = "scaling.efficiency_pct"


def coverage_problems(cell_keys: list[str], thresholds: dict, multinode_scaling: bool) -> list[str]:
    """What an enforced run's threshold file lacks: gated metrics per gated cell and, on a multi-node
    run with a scaling baseline, `scaling.efficiency_pct` in every cell. Empty when complete."""
    problems = []
    gaps = {}
    for key in cell_keys:
        specs = thresholds.get(key)
        if not isinstance(specs, dict):
            continue  # not a gated cell: it is recorded with one SKIP row
        absent = [m for m in GATED_METRICS if m not in specs]
        if absent:
            gaps[key] = absent
    for key, absent in gaps.items():
        problems.append(f"cell {key} has no spec for gated metrics {', '.join(absent)}")
    if multinode_scaling:
        missing = [k for k in cell_keys if SCALING_METRIC not in (thresholds.get(k) or {})]
        if missing:
            problems.append(
                "a multi-node run with params.scaling_baseline_output_throughput needs "
                f"{SCALING_METRIC} in every cell; missing in {', '.join(missing)}"
            )
    return problems


def flatten_block_specs(specs: dict) -> dict[str, dict]:
    """A block's threshold entry as {metric: spec}: `{metric: spec}` stays, `{group: {metric: spec}}`
    (CVS groups accuracy by task id) becomes `{"group/metric": spec}`."""
    out: dict[str, dict] = {}
    for name, value in specs.items():
        if str(name).startswith("_"):
            continue
        if isinstance(value, dict) and "kind" not in value:
            for metric, spec in value.items():
                if not str(metric).startswith("_"):
                    out[f"{name}/{metric}"] = spec
        else:
            out[name] = value
    return out


def gate_block(block: str, metrics: dict, specs: dict) -> list[GateRow]:
    """Gate one block's metrics; a metric the block did not produce is SKIPped (reported as such)."""
    rows = []
    for metric, spec in flatten_block_specs(specs).items():
        kind = str(spec.get("kind")) if isinstance(spec, dict) else "?"
        actual = metrics.get(metric)
        verdict = evaluate(spec, actual, metrics)
        rows.append(GateRow(block, metric, kind, describe_threshold(spec), actual, verdict.status, verdict.reason))
    return rows


def render_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def format_gate_table(rows: list[GateRow]) -> str:
    headers = ["cell", "metric", "kind", "threshold", "actual", "verdict", "reason"]
    body = [[r.cell, r.metric, r.kind, r.threshold, format_value(r.actual), str(r.status), r.reason] for r in rows]
    return render_table(headers, body)
