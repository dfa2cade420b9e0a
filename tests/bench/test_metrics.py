"""Benchmark metrics from synthetic per-request timings, checked against hand-computed values."""

import math

import pytest

from atomc.bench.client import RequestResult
from atomc.bench.metrics import (
    compute_metrics,
    format_metrics_table,
    is_known_metric,
    parse_percentiles,
)


def synthetic_results() -> list[RequestResult]:
    return [
        # tpot = (0.2 - 0.1) / 3
        RequestResult(True, prompt_len=10, output_tokens=4, ttft=0.1, itl=[0.02, 0.03, 0.05], latency=0.2),
        # tpot = (0.4 - 0.3) / 1
        RequestResult(True, prompt_len=20, output_tokens=2, ttft=0.3, itl=[0.1], latency=0.4),
        RequestResult(False, prompt_len=30, error="HTTP 500"),
        # a single token has no TPOT
        RequestResult(True, prompt_len=5, output_tokens=1, ttft=0.05, itl=[], latency=0.05),
    ]


def test_counts_and_throughput():
    m = compute_metrics(synthetic_results(), duration_s=2.0, num_prompts=4)
    assert (m["completed"], m["failed"], m["success_rate"]) == (3, 1, 0.75)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (35, 7)  # failed prompt not counted
    assert m["duration"] == 2.0
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(3.5)
    assert m["total_token_throughput"] == pytest.approx(21.0)


def test_ttft_statistics():
    m = compute_metrics(synthetic_results(), 2.0, 4)
    # ttft ms = [100, 300, 50]; numpy's linear percentiles over sorted [50, 100, 300]
    assert m["mean_ttft_ms"] == pytest.approx(150.0)
    assert m["median_ttft_ms"] == pytest.approx(100.0)
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt((50**2 + 150**2 + 100**2) / 3))
    assert m["p90_ttft_ms"] == pytest.approx(260.0)
    assert m["p95_ttft_ms"] == pytest.approx(280.0)
    assert m["p99_ttft_ms"] == pytest.approx(296.0)


def test_tpot_itl_e2el():
    m = compute_metrics(synthetic_results(), 2.0, 4)
    assert m["mean_tpot_ms"] == pytest.approx((100 / 3 + 100) / 2)
    assert m["median_tpot_ms"] == pytest.approx((100 / 3 + 100) / 2)
    # itl ms = [20, 30, 50, 100]
    assert m["mean_itl_ms"] == pytest.approx(50.0)
    assert m["median_itl_ms"] == pytest.approx(40.0)
    assert m["p90_itl_ms"] == pytest.approx(85.0)
    # e2el ms = [200, 400, 50]
    assert m["mean_e2el_ms"] == pytest.approx(650 / 3)
    assert m["median_e2el_ms"] == pytest.approx(200.0)


def test_no_completed_request_gives_missing_latencies_not_zero():
    m = compute_metrics([RequestResult(False), RequestResult(False)], 1.0, 2)
    assert (m["completed"], m["failed"], m["success_rate"]) == (0, 2, 0.0)
    assert m["output_throughput"] == 0.0
    assert m["p99_ttft_ms"] is None and m["mean_tpot_ms"] is None


def test_extra_percentiles():
    assert parse_percentiles("95,99.9") == (90, 95, 99, 99.9)
    assert parse_percentiles([50]) == (50, 90, 95, 99)
    assert parse_percentiles(None) == (90, 95, 99)
    m = compute_metrics(synthetic_results(), 2.0, 4, parse_percentiles("50,99.9"))
    assert m["p50_ttft_ms"] == pytest.approx(100.0)
    assert "p99.9_itl_ms" in m


def test_every_produced_metric_is_known():
    m = compute_metrics(synthetic_results(), 2.0, 4, parse_percentiles("99.9"))
    assert all(is_known_metric(k) for k in m)
    assert is_known_metric("p50_e2el_ms") and is_known_metric("num_prompts")
    assert not is_known_metric("p99_tftt_ms") and not is_known_metric("throughput")


def test_table_lists_every_metric():
    m = compute_metrics(synthetic_results(), 2.0, 4)
    table = format_metrics_table(m)
    for key in m:
        assert key + ":" in table
