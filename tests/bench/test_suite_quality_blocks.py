"""`atomc bench sweep` with the accuracy and long-context blocks next to the functional ones, end
to end against `atomc serve` on a tiny llama: the suite runs them after the sweep, gives them
the threshold file, puts their results in report.json, and the run deck shows them."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from atomc.bench.blocks import accuracy
from atomc.bench.cli import bench_app
from atomc.bench.thresholds import GATED_METRICS
from tests.bench.block_servers import tiny_llama_server

CELL = "ISL=16,OSL=4,TP=1,PP=1,CONC=2"
FLEX = "atomc_arith.exact_match__flexible-extract"
NIAH = "accuracy.niah_pass_rate__short"


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    from tests.conftest import build_checkpoint

    model_dir = build_checkpoint("llama", tmp_path_factory.mktemp("suite_llama"))
    with tiny_llama_server(model_dir) as (url, name):
        yield url, name


@pytest.mark.skipif(accuracy.lm_eval_available() is not None, reason=str(accuracy.lm_eval_available()))
def test_a_sweep_with_functional_accuracy_and_niah_blocks(tiny_server, tmp_path):
    url, _name = tiny_server
    config = {
        "schema_version": 1,
        "enforce_thresholds": True,
        "threshold_json": "t_threshold.json",
        "model": {"id": None},
        "params": {"num_prompts": "2", "max_model_length": "512"},
        "functional": {"api_smoke": True, "health_check": True},
        "accuracy": {"tasks": [{"id": "arith", "task": "atomc_arith", "limit": 2, "gen_kwargs": {"max_gen_toks": 4}}]},
        "long_context_accuracy": {"cells": [{"id": "short", "isl": 200, "depths": [0, 1], "num_prompts": 2, "osl": 4}]},
        "sweep": {"sequence_combinations": [{"name": "tiny", "isl": "16", "osl": "4"}],
                  "runs": [{"combo": "tiny", "concurrency": 2}]},
    }  # fmt: skip
    loose = {"success_rate": {"kind": "min", "value": 1}, "failed": {"kind": "max", "value": 0}}
    thresholds = {
        CELL: {m: loose.get(m, {"kind": "info"}) for m in GATED_METRICS},
        # a random model scores ~0: floors of 0 pass, so the run passes end to end
        "accuracy": {"arith": {FLEX: {"kind": "min", "value": 0}}},
        "long_context_accuracy": {"short": {NIAH: {"kind": "min", "value": 0}}},
    }
    (tmp_path / "c.json").write_text(json.dumps(config))
    (tmp_path / "t_threshold.json").write_text(json.dumps(thresholds))
    out = tmp_path / "out"
    result = CliRunner().invoke(
        bench_app,
        ["sweep", "--disable-tqdm", "--vocab-size", "384", "--config", str(tmp_path / "c.json"),
         "--base-url", url, "--output-dir", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    blocks = {b["block"]: b for b in report["blocks"]}
    assert {"functional.api_smoke", "functional.health_check", "accuracy", "long_context_accuracy"} <= set(blocks)
    acc, niah = blocks["accuracy"], blocks["long_context_accuracy"]
    assert acc["verdict"] == "PASS", acc["reason"]
    assert [g["status"] for g in acc["rows"][0]["gates"]] == ["PASS"] and f"arith/{FLEX}" in acc["metrics"]
    assert niah["verdict"] == "PASS", niah["reason"]
    assert niah["metrics"] == {NIAH: 0.0} and niah["rows"][0]["length_source"] == "tokenize"
    html = (out / "run_deck.html").read_text()
    assert "Accuracy" in html and "Long-context accuracy" in html and FLEX in html
    assert "prev_run" not in json.loads((out / "run_deck.json").read_text())["panels"]
    assert "run deck:" in result.output
