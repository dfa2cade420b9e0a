"""Threshold gating for `atomc bench sweep`: the pure rules, cell gating, exit codes, cell keys."""

import json
from pathlib import Path

import pytest

from atomc.bench.sweep import SweepConfigError, cell_key, load_sweep_config
from atomc.bench.thresholds import (
    GateRow,
    Status,
    evaluate,
    exit_code,
    gate_cells,
    unmatched_threshold_cells,
)


@pytest.mark.parametrize(
    "spec, actual, status",
    [
        ({"kind": "min", "value": 1}, 1.0, Status.PASS),
        ({"kind": "min", "value": 1}, 0.875, Status.FAIL),
        ({"kind": "max", "value": 0}, 0, Status.PASS),
        ({"kind": "max", "value": 0}, 2, Status.FAIL),
        ({"kind": "max_ms", "value": 500}, 499.9, Status.PASS),
        ({"kind": "max_ms", "value": 500}, 500.1, Status.FAIL),
        ({"kind": "min_tok_s", "value": 1500}, 1600.0, Status.PASS),
        ({"kind": "min_tok_s", "value": 1500}, 1400.0, Status.FAIL),
    ],
)
def test_bound_kinds(spec, actual, status):
    assert evaluate(spec, actual, None).status is status


def test_missing_metric_is_skipped():
    verdict = evaluate({"kind": "max_ms", "value": 10}, None, {})
    assert verdict.status is Status.SKIP
    assert "missing" in verdict.reason


def test_unknown_kind_fails_even_without_a_value():
    verdict = evaluate({"kind": "at_least", "value": 1}, 5.0, None)
    assert verdict.status is Status.FAIL
    assert "unknown threshold kind 'at_least'" in verdict.reason
    # a config error must not hide behind a missing metric either
    assert evaluate({"kind": "typo"}, None, None).status is Status.FAIL


@pytest.mark.parametrize("spec", [{"kind": "min"}, {"kind": "max", "value": "10"}, {"kind": "min", "value": True}])
def test_bad_value_fails(spec):
    assert evaluate(spec, 1.0, None).status is Status.FAIL


def test_info_is_always_recorded():
    assert evaluate({"kind": "info"}, 12.5, None).status is Status.INFO
    assert evaluate({"kind": "info"}, None, None).status is Status.INFO


def test_within_absolute_and_relative():
    absolute = {"kind": "within", "reference": 100, "tolerance": 5}
    assert evaluate(absolute, 104.0, None).status is Status.PASS
    assert evaluate(absolute, 94.0, None).status is Status.FAIL
    relative = {"kind": "within", "reference": 200, "tolerance_pct": 10}
    assert evaluate(relative, 181.0, None).status is Status.PASS
    assert evaluate(relative, 179.0, None).status is Status.FAIL


def test_within_ref_metric_and_config_errors():
    spec = {"kind": "within", "ref_metric": "median_ttft_ms", "tolerance": 1}
    assert evaluate(spec, 10.5, {"median_ttft_ms": 10.0}).status is Status.PASS
    assert evaluate(spec, 12.0, {"median_ttft_ms": 10.0}).status is Status.FAIL
    assert evaluate(spec, 12.0, {}).status is Status.SKIP  # the reference was not produced
    assert evaluate({"kind": "within", "tolerance": 1}, 1.0, None).status is Status.FAIL
    assert evaluate({"kind": "within", "reference": 1}, 1.0, None).status is Status.FAIL


def test_min_ratio():
    spec = {"kind": "min_ratio", "value": 0.9, "reference": 1000}
    assert evaluate(spec, 950.0, None).status is Status.PASS
    assert evaluate(spec, 850.0, None).status is Status.FAIL
    assert evaluate({**spec, "reference": 0}, 1.0, None).status is Status.FAIL
    by_metric = {"kind": "min_ratio", "value": 2, "ref_metric": "request_throughput"}
    assert evaluate(by_metric, 8.0, {"request_throughput": 4.0}).status is Status.PASS


CELL = "ISL=32,OSL=16,TP=1,PP=1,CONC=1"


def test_gate_cells_rows_and_unknown_metric():
    metrics = {"success_rate": 1.0, "failed": 0, "mean_tpot_ms": 3.0}
    thresholds = {
        "_comment": "ignored",
        "accuracy": {"gsm8k": {"kind": "min", "value": 0.5}},  # not a sweep cell
        CELL: {
            "success_rate": {"kind": "min", "value": 1},
            "failed": {"kind": "max", "value": 0},
            "p99_ttft_ms": {"kind": "max_ms", "value": 100},  # known, not in results -> SKIP
            "mean_tpot_ms": {"kind": "info"},
            "p99_tftt_ms": {"kind": "max_ms", "value": 100},  # typo -> FAIL
            "scaling.efficiency_pct": {"kind": "min", "value": 80},  # CVS-only -> SKIP
        },
        "ISL=1,OSL=1,TP=1,PP=1,CONC=1": {},
    }
    rows = {r.metric: r for r in gate_cells({CELL: metrics}, thresholds)}
    assert rows["success_rate"].status is Status.PASS
    assert rows["failed"].status is Status.PASS
    assert rows["p99_ttft_ms"].status is Status.SKIP
    assert rows["mean_tpot_ms"].status is Status.INFO
    assert rows["p99_tftt_ms"].status is Status.FAIL and "never produces" in rows["p99_tftt_ms"].reason
    assert rows["scaling.efficiency_pct"].status is Status.SKIP
    assert rows["success_rate"].threshold == ">= 1"
    assert unmatched_threshold_cells({CELL: metrics}, thresholds) == ["ISL=1,OSL=1,TP=1,PP=1,CONC=1"]


def test_cell_without_thresholds_is_reported_not_failed():
    rows = gate_cells({CELL: {"failed": 3}}, {})
    assert [(r.cell, r.status, r.reason) for r in rows] == [(CELL, Status.SKIP, "no thresholds for cell")]
    assert exit_code(rows, enforce=True) == 0


def _row(status):
    return GateRow(CELL, "failed", "max", "<= 0", 1, status, "")


def test_exit_code_only_fails_when_enforced():
    failing = [_row(Status.PASS), _row(Status.FAIL), _row(Status.INFO)]
    assert exit_code(failing, enforce=True) == 1
    assert exit_code(failing, enforce=False) == 0
    assert exit_code([_row(Status.PASS), _row(Status.SKIP)], enforce=True) == 0


def test_cell_key_format_matches_cvs():
    assert cell_key(1024, 1024, 1, 1, 64) == "ISL=1024,OSL=1024,TP=1,PP=1,CONC=64"


def test_config_cells_and_private_keys(tmp_path):
    config = {
        "_comment": "x",
        "schema_version": 1,
        "model": {"id": None},
        "params": {"num_prompts": 8, "tensor_parallelism": 8, "pipeline_parallel_size": 2, "_note": 1},
        "roles": {"server": {"atom_args": "--max-num-seqs 4"}},
        "sweep": {
            "sequence_combinations": [{"name": "a", "isl": "1024", "osl": 128, "_c": 0}],
            "runs": [{"combo": "a", "concurrency": 64}, {"combo": "a", "concurrency": 1, "num_prompts": 2}],
        },
    }
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(config))
    cfg = load_sweep_config(path)
    assert [c.key for c in cfg.cells] == [
        "ISL=1024,OSL=128,TP=8,PP=2,CONC=64",
        "ISL=1024,OSL=128,TP=8,PP=2,CONC=1",
    ]
    assert [c.num_prompts for c in cfg.cells] == [8, 2]
    assert cfg.server_args == ["--max-num-seqs", "4"]
    assert "_note" not in cfg.params and cfg.enforce_thresholds is False

    config["sweep"]["runs"].append({"combo": "missing", "concurrency": 1})
    path.write_text(json.dumps(config))
    with pytest.raises(SweepConfigError, match="unknown combo"):
        load_sweep_config(path)


def test_shipped_examples_agree():
    examples = Path(__file__).resolve().parents[2] / "examples" / "bench"
    cfg = load_sweep_config(examples / "tiny_sweep.json")
    thresholds = json.loads((examples / cfg.threshold_json).read_text())
    keys = [c.key for c in cfg.cells]
    assert keys == [k for k in thresholds if not k.startswith("_")]
    assert cfg.model_id is None and cfg.enforce_thresholds


def test_sweep_cells_get_distinct_prompts():
    """Cells share one server: the same prompts in two cells would be prefix-cache hits."""
    from atomc.bench.dataset import sample_random_requests
    from atomc.bench.sweep import SweepCell, SweepConfig, bench_config_for

    cells = [SweepCell("c", 64, 8, 1, 1, conc, conc) for conc in (2, 4)]
    cfg = SweepConfig(Path("sweep.json"), None, {"seed": 5}, cells)
    benches = [bench_config_for(c, cfg, "http://x", "m", i, vocab_size=1000) for i, c in enumerate(cells, 1)]
    assert [b.seed for b in benches] == [6, 7]
    first, second = (sample_random_requests(2, 64, 8, 0.0, 1000, b.seed) for b in benches)
    assert first[0].prompt_ids != second[0].prompt_ids
