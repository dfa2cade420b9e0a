"""The DeepSeek benchmarks' own logic on the CPU (benchmarks/deepseek_layers.py, the DeepSeek-V2-Lite
entries of decode_bs1_moe.py and moe_suite.sh): the per-layer fit and projection, the resumed
build-by-build run with one real tiny build, transformers' static cache on DeepSeek-V2, the
suite's serving call."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import ceilings  # noqa: E402
import checkpoints  # noqa: E402
import deepseek_layers  # noqa: E402
import moe_summary  # noqa: E402


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}


def test_fit_recovers_the_layer_times():
    def t(d, m):
        return 1.5 + 2.0 * d + 7.0 * m

    exact = deepseek_layers.fit_layers([(d, m, t(d, m)) for d, m in ((3, 4), (3, 1), (1, 1))])
    assert exact["rest"] == pytest.approx(1.5) and exact["dense_layer"] == pytest.approx(2.0)
    assert exact["moe_layer"] == pytest.approx(7.0) and exact["max_residual"] == pytest.approx(0, abs=1e-9)
    # a fourth, noisy build: least squares, with the residual reported
    noisy = deepseek_layers.fit_layers([(3, 4, t(3, 4)), (3, 1, t(3, 1)), (1, 1, t(1, 1)), (1, 4, t(1, 4) + 0.4)])
    assert noisy["moe_layer"] == pytest.approx(7.0, abs=0.2) and 0.05 < noisy["max_residual"] < 0.4
    # the dense count never varies, or too few builds: the three terms are not pinned
    assert deepseek_layers.fit_layers([(3, 4, t(3, 4)), (3, 1, t(3, 1)), (3, 2, t(3, 2))]) is None
    assert deepseek_layers.fit_layers([(3, 4, 1.0), (1, 1, 2.0)]) is None


def test_parse_builds():
    assert deepseek_layers.parse_builds("3+4, 1+0") == [(3, 4), (1, 0)]
    for bad in ("3", "3+x", "0+0", "3-4"):
        with pytest.raises(SystemExit, match="DENSE\\+MOE"):
            deepseek_layers.parse_builds(bad)


def _cells(d: int, m: int, context: int = 100) -> list[dict]:
    # made-up times: rest 1 / 2 ms, dense 0.5 / 0.6 ms, MoE 3 / 9 ms a layer at CONC 1 / 64
    return [
        {"conc": 1, "context": context, "step_ms": 1 + 0.5 * d + 3 * m, "graph_ms": 0.8 + 0.5 * d + 3 * m},
        {"conc": 64, "context": context, "step_ms": 2 + 0.6 * d + 9 * m, "graph_ms": None},
    ]


def test_derive_projects_the_published_layer_counts():
    builds = {f"{d}+{m}": {"dense": d, "moe": m, "cells": _cells(d, m)} for d, m in ((3, 4), (3, 1), (1, 1))}
    rows = deepseek_layers.derive(builds, [1, 64], 4e12, tiny=False)
    one, many = rows
    assert (deepseek_layers.PROJECTED_DENSE, deepseek_layers.PROJECTED_MOE) == (3, 58)
    assert one["step_ms"]["projected_tpot_ms"] == pytest.approx(1 + 3 * 0.5 + 58 * 3)
    assert one["graph_ms"]["projected_tpot_ms"] == pytest.approx(0.8 + 3 * 0.5 + 58 * 3)
    assert many["step_ms"]["projected_tok_s"] == pytest.approx(64e3 / (2 + 3 * 0.6 + 58 * 9))
    assert "graph_ms" not in many  # no GPU time measured at that concurrency
    # the rooflines: the bytes of each part of V3 at the timed context over the bandwidth
    part = ceilings.moe_layer_bytes(checkpoints.deepseek_v3_layers(58), 64, 100)
    assert many["roofline_ms"]["moe_layer"] == pytest.approx(1e3 * part["sparse"] / 4e12)
    assert many["step_ms"]["moe_layer_roofline_pct"] == pytest.approx(100 * 1e3 * part["sparse"] / 4e12 / 9)
    # --fp8: the same fit against the block-FP8 bytes (about half), on its own builds
    (fp8,) = deepseek_layers.derive(builds, [64], 4e12, tiny=False, fp8=True)
    part8 = ceilings.moe_layer_bytes(checkpoints.deepseek_v3_layers(58, fp8=True), 64, 100, weights="fp8_block")
    assert fp8["roofline_ms"]["moe_layer"] == pytest.approx(1e3 * part8["sparse"] / 4e12)
    assert fp8["roofline_ms"]["moe_layer"] < 0.6 * many["roofline_ms"]["moe_layer"]
    assert deepseek_layers.build_dir(Path("r"), 1, 1, False, True).name == "deepseek-v3-layers-1d1m-fp8"
    # builds that do not pin the terms give no projection, and say why
    (row,) = deepseek_layers.derive({"3+4": builds["3+4"], "3+1": builds["3+1"]}, [1], 4e12, tiny=False)
    assert "step_ms" not in row and "vary the dense and the MoE" in row["note"]


@pytest.mark.slow
def test_layers_tiny_run_resumes_and_fits(tmp_path):
    # two builds as a previous call left them (same settings), the third one measured here for real
    # on the CPU in its own process; the fit then has the three it needs
    out = tmp_path / "layers.json"
    args = type(
        "Args",
        (),
        dict(tiny=True, fp8=False, **{k: deepseek_layers.TINY[k] for k in ("conc", "isl", "warmup", "steps")}),
    )
    previous = {
        f"{d}+{m}": {"dense": d, "moe": m, "startup_s": 1.0, "cells": _tiny_cells(d, m)} for d, m in ((1, 0), (0, 1))
    }
    out.write_text(json.dumps({"settings": deepseek_layers.settings_of(args), "builds": previous}))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "deepseek_layers.py"), "--tiny", "--builds", "1+1",
           "--root", str(tmp_path / "models"), "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "reusing build 0+1" in proc.stdout and "reusing build 1+0" in proc.stdout
    res = json.loads(out.read_text())
    real = res["builds"]["1+1"]
    assert [c["conc"] for c in real["cells"]] == [1, 4] and all(c["step_ms"] > 0 for c in real["cells"])
    assert real["cuda_graphs"] is False and all(c["graph_ms"] is None for c in real["cells"])
    assert (tmp_path / "layers.1d1m.log").is_file()
    for row in res["per_layer"]:
        fit = row["step_ms"]
        assert row["builds"] == ["0+1", "1+0", "1+1"] and fit["max_residual"] == pytest.approx(0, abs=1e-9)
        assert fit["projected_tpot_ms"] == pytest.approx(fit["rest"] + 3 * fit["dense_layer"] + 58 * fit["moe_layer"])
    assert "61 layers" in proc.stdout
    # other settings: nothing reused
    assert deepseek_layers.previous_builds(out, dict(deepseek_layers.settings_of(args), isl=99)) == {}


def _tiny_cells(d: int, m: int) -> list[dict]:
    return [{"conc": c, "context": 20, "step_ms": 2.0 + 1.0 * d + 3.0 * m, "graph_ms": None} for c in (1, 4)]


def test_transformers_static_cache_runs_deepseek_v2(tmp_path):
    # decode_bs1_moe's peer for DeepSeek-V2-Lite: generate with cache_implementation="static"
    # (transformers caches the latent as one-head keys and values), on the toy shape
    import decode_bs1

    folder = checkpoints.make_checkpoint("deepseek-v2-lite", tmp_path, tiny=True)
    res = decode_bs1.run_hf(str(folder), device="cpu", prompt_len=8, output_len=6, vocab=512)
    assert res["engine"].startswith("transformers static cache") and res["e2e_tok_s"] > 0


def test_suite_runs_deepseek_serving_at_its_concurrencies(tmp_path):
    # the suite's calls, with a stand-in Python that records its arguments
    log = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\necho "$@" >> {log}\n')
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "MODELS_DIR": str(tmp_path / "m")}
    suite = str(ROOT / "benchmarks" / "moe_suite.sh")
    cmd = ["bash", suite, "deepseek-v2-lite", str(tmp_path / "out"), "all"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    decode, serving, summary = log.read_text().splitlines()
    assert decode.startswith("benchmarks/decode_bs1_moe.py --model deepseek-v2-lite")
    assert serving.startswith("benchmarks/serving.py --model deepseek-v2-lite")
    assert serving.split()[-5:-2] == ["--conc", "1,8,32,64", "--skip-hf"] and summary.startswith(
        "benchmarks/moe_summary.py"
    )
    bad = subprocess.run(["bash", suite, "deepseek-v3", str(tmp_path / "o")], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "deepseek-v2-lite" in bad.stderr


def test_summary_shows_the_latent_cache(tmp_path):
    row = {
        "conc": 8, "output_throughput": 900.0, "ceiling_tok_s": 1861.6, "ceiling_pct": 48.3, "experts": 64,
        "distinct_experts_per_layer": 34.88, "kv_bytes_per_token": 31104, "completed": 8, "num_prompts": 8,
    }  # fmt: skip
    (tmp_path / "serving_deepseek-v2-lite.json").write_text(
        json.dumps({"model": "deepseek-v2-lite", "isl": 1024, "osl": 1024, "atomc": [row]})
    )
    (line,) = moe_summary.summary(tmp_path).splitlines()[2:]
    assert "CONC 8 | atomc | 900 | 48% of 1,862 | D = 34.9 of 64 experts; KV 31.1 kB a token;" in line


def test_default_builds_fit_the_gpu():
    """3+m with m the MoE layers whose weights fit 80% of the memory: an 80 GiB H100 takes 3+2 in
    bf16 (a V3 MoE layer is 23 GB; 3+4 is ~99 GB) and 3+4 in FP8; an H200 (141 GB) 3+4 in both."""
    from checkpoints import deepseek_v3_layers

    cfg = deepseek_v3_layers(1, 3)
    assert 22e9 < deepseek_layers.layer_weight_bytes(cfg, True, False) < 24e9
    assert 11e9 < deepseek_layers.layer_weight_bytes(cfg, True, True) < 12e9
    h100, h200 = 80 * 2**30, 141 * 10**9
    assert deepseek_layers.default_builds(h100, fp8=False) == "3+2,3+1,1+1"
    assert deepseek_layers.default_builds(h100, fp8=True) == "3+4,3+1,1+1"
    assert deepseek_layers.default_builds(h200, fp8=False) == "3+4,3+1,1+1"
    assert deepseek_layers.default_builds(10 * 2**30, fp8=False) == "3+2,3+1,1+1"  # 2 at least: the fit needs them
