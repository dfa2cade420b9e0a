"""Turn per-request timings into vLLM-named benchmark metrics."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import numpy as np

from atomc.bench.client import RequestResult

DEFAULT_PERCENTILES: tuple[float, ...] = (90, 95, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
SCALAR_METRICS = (
    "completed",
    "failed",
    "success_rate",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
)
RUN_FIELDS = ("num_prompts", "max_concurrency", "request_rate", "input_len", "output_len")
# derived by the sweep from the metrics above: tok/s per GPU (TP x PP GPUs) and, for multi-node runs
# with params.scaling_baseline_output_throughput, output tok/s against nnodes x the single-node baseline
DERIVED_METRICS = ("per_gpu_throughput", "output_tput_per_gpu", "scaling.efficiency_pct")
_LATENCY_NAME = re.compile(r"^(mean|median|std|p\d+(\.\d+)?)_(ttft|tpot|itl|e2el)_ms$")


def percentile_key(p: float) -> str:
    return f"p{p:g}"


def parse_percentiles(value: str | Iterable[float] | None) -> tuple[float, ...]:
    """CVS writes `metric_percentiles` as "95,99"; the defaults p90/p95/p99 are always included."""
    if value is None or value == "":
        extra: list[float] = []
    elif isinstance(value, str):
        extra = [float(v) for v in value.split(",") if v.strip()]
    elif isinstance(value, int | float):
        extra = [float(value)]
    else:
        extra = [float(v) for v in value]
    return tuple(sorted(set(DEFAULT_PERCENTILES) | set(extra)))


def is_known_metric(name: str) -> bool:
    """True for every name `compute_metrics` can produce (any percentile) and the derived ones."""
    return (
        name in SCALAR_METRICS
        or name in RUN_FIELDS
        or name in DERIVED_METRICS
        or _LATENCY_NAME.match(name) is not None
    )


def summarize_ms(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict:
    """mean/median/std/pXX of `values_s` (seconds) in milliseconds; None when there is no sample,
    so a gate on it is skipped instead of passing on a made-up 0."""
    keys = ["mean", "median", "std", *(percentile_key(p) for p in percentiles)]
    if len(values_s) == 0:
        return {f"{k}_{name}_ms": None for k in keys}
    ms = np.asarray(values_s, dtype=float) * 1000.0
    out = {
        f"mean_{name}_ms": float(np.mean(ms)),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(np.std(ms)),
    }
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def compute_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    num_prompts: int | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict:
    """Aggregate metrics over one run. Token totals and latencies count completed requests only;
    `failed` and `success_rate` count against `num_prompts` (default: len(results))."""
    num_prompts = len(results) if num_prompts is None else num_prompts
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    metrics: dict = {
        "completed": len(ok),
        "failed": num_prompts - len(ok),
        "success_rate": len(ok) / num_prompts if num_prompts else 0.0,
        "duration": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
    }
    # TPOT excludes the first token (that is TTFT) and is undefined for a single-token output
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": tpots,
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    for name in LATENCY_METRICS:
        metrics.update(summarize_ms(name, samples[name], percentiles))
    return metrics


def format_value(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def format_metrics_table(metrics: dict, title: str = "Serving Benchmark Result") -> str:
    """The result as aligned `name: value` lines, in the order the metrics were produced."""
    width = max(len(k) for k in metrics) + 2
    bar = f"{' ' + title + ' ':=^{width + 16}}"
    lines = [bar]
    lines += [f"{key + ':':<{width}}{format_value(value):>16}" for key, value in metrics.items()]
    lines.append("=" * len(bar))
    return "\n".join(lines)
