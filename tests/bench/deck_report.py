"""A synthetic run report (the sweep's results plus block results) for the run-deck tests."""

from __future__ import annotations


def cell(conc: int, isl: int, osl: int, scale: float = 1.0) -> dict:
    tput = scale * 120.0 * conc**0.8
    return {
        "combo": f"{isl}/{osl}",
        "input_len": isl,
        "output_len": osl,
        "max_concurrency": conc,
        "num_prompts": 4 * conc,
        "completed": 4 * conc,
        "failed": 0,
        "success_rate": 1.0,
        "output_throughput": tput,
        "mean_ttft_ms": 40.0 + 9.0 * conc,
        "p99_ttft_ms": 80.0 + 20.0 * conc,
        "mean_tpot_ms": 8.0 + 0.5 * conc,
        "mean_itl_ms": 8.0 + 0.5 * conc,
    }


def report(scale: float = 1.0, arith: float = 0.62, niah: float = 0.75) -> dict:
    cells = {}
    for isl, osl in ((1024, 1024), (128, 2048)):
        for conc in (1, 2, 4, 8, 16):
            cells[f"ISL={isl},OSL={osl},TP=1,PP=1,CONC={conc}"] = cell(conc, isl, osl, scale)
    key = "ISL=1024,OSL=1024,TP=1,PP=1,CONC=16"
    gates = [
        {
            "cell": key,
            "metric": "output_throughput",
            "kind": "min_tok_s",
            "threshold": ">= 1500",
            "actual": cells[key]["output_throughput"],
            "status": "PASS" if cells[key]["output_throughput"] >= 1500 else "FAIL",
            "reason": "synthetic",
        },
        {
            "cell": key,
            "metric": "p99_ttft_ms",
            "kind": "max_ms",
            "threshold": "<= 5000",
            "actual": 400.0,
            "status": "PASS",
            "reason": "400 <= 5000",
        },
        {
            "cell": "ISL=128,OSL=2048,TP=1,PP=1,CONC=1",
            "metric": "-",
            "kind": "-",
            "threshold": "-",
            "actual": None,
            "status": "SKIP",
            "reason": "no thresholds for cell",
        },
    ]
    metrics = {
        "atomc_arith.exact_match__flexible-extract": arith,
        "atomc_arith.exact_match_stderr__flexible-extract": 0.03,
        "atomc_arith.exact_match__strict-match": arith - 0.1,
    }
    accuracy = {
        "block": "accuracy",
        "verdict": "FAIL",
        "reason": "arith: below 0.9",
        "metrics": {f"arith/{k}": v for k, v in metrics.items()},
        "rows": [
            {
                "id": "arith",
                "tasks": ["atomc_arith"],
                "model": "local-completions",
                "metrics": metrics,
                "gates": [
                    {
                        "task": "arith",
                        "metric": "atomc_arith.exact_match__flexible-extract",
                        "threshold": ">= 0.9",
                        "actual": arith,
                        "status": "FAIL",
                        "reason": f"{arith} not >= 0.9",
                    }
                ],
                "status": "FAIL",
            }
        ],
        "samples": [],
    }
    grid = [
        {
            "length": n,
            "depth": d,
            "prompts": 2,
            "retrieved": r,
            "pass_rate": r / 2,
            "length_source": "tokenize",
            "measured_tokens": n - 3,
            "prompt_tokens": n - 2,
        }
        for n, row in ((1024, (2, 2, 1)), (4096, (2, 1, 0)))
        for d, r in zip((0.0, 0.5, 1.0), row, strict=True)
    ]
    niah_block = {
        "block": "long_context_accuracy",
        "verdict": "PASS",
        "reason": "pass rates: 4k 0.75",
        "metrics": {"accuracy.niah_pass_rate__4k": niah},
        "rows": [
            {
                "id": "4k",
                "lengths": [1024, 4096],
                "depths": [0.0, 0.5, 1.0],
                "grid": grid,
                "prompts": 12,
                "length_source": "tokenize",
                "pass_rate": niah,
                "status": "PASS",
                "gates": [
                    {
                        "metric": "accuracy.niah_pass_rate__4k",
                        "threshold": ">= 0.5",
                        "actual": niah,
                        "status": "PASS",
                        "reason": f"{niah} >= 0.5",
                    }
                ],
            }
        ],
        "samples": [],
    }
    samples = [
        {
            "t": t * 2.0,
            "gpu": g,
            "power_w": 300 + 50 * g + 10 * (t % 5),
            "temp_c": 50 + t * 0.5 + g,
            "sm_clock_mhz": 1900 - 5 * t,
        }
        for t in range(20)
        for g in (0, 1)
    ]
    platform = {
        "block": "platform.gpu_metrics_poll",
        "verdict": "PASS",
        "reason": "40 samples",
        "metrics": {},
        "rows": [],
        "samples": samples,
    }
    return {
        "config": "examples/bench/h200_8b.json",
        "threshold_file": "h200_8b_threshold.json",
        "enforce_thresholds": True,
        "base_url": "http://127.0.0.1:8000",
        "model": "llama-3.1-8b",
        "cells": cells,
        "gates": gates,
        "blocks": [accuracy, niah_block, platform],
        "exit_code": 1,
        "profile": "perf",
        "driver": "atom",
    }
