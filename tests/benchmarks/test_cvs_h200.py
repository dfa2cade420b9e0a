"""The H200 reference run of `atomc bench sweep` (benchmarks/cvs_h200.sh and benchmarks/cvs/) checked on
the CPU: the config loads and its thresholds cover it, the sweep's estimated time fits one device
call, and the script runs end to end at toy size (the `tiny` profile), so the only thing new on the
GPU is the GPU."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from atomc.bench.config import load_sweep_config, load_thresholds, resolve_threshold_path
from atomc.bench.suite import check_thresholds

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "benchmarks" / "cvs" / "h200_atom_llama-3.1-8b_bf16_single.json"
SCRIPT = ROOT / "benchmarks" / "cvs_h200.sh"
CONCS = [1, 2, 4, 8, 16, 32, 64, 128]


@pytest.mark.parametrize("profile", ["perf", "tiny"])
def test_reference_config_loads_and_its_thresholds_cover_it(profile):
    cfg = load_sweep_config(CONFIG, profile)
    assert cfg.enforce_thresholds and cfg.native and cfg.notes == []  # no cell past max_model_length
    thresholds = load_thresholds(resolve_threshold_path(cfg, None), profile)
    assert check_thresholds(cfg, thresholds, enforce=True) == []  # would raise on a gap
    assert {c.key for c in cfg.cells} == set(thresholds) - {"_comment"}
    # speed and platform only: random weights make accuracy and NIAH meaningless (docs say why)
    assert set(cfg.blocks) == {"functional", "platform"}
    assert "--load-format" in cfg.server_args and "dummy" in cfg.server_args
    assert cfg.model_id.endswith("llama-3.1-8b" + ("-tiny" if profile == "tiny" else ""))


def test_perf_profile_is_the_issue_sweep_on_one_h200():
    cfg = load_sweep_config(CONFIG, "perf")
    assert cfg.gpu_arch == "h200" and cfg.params["tensor_parallelism"] == 1
    shapes: dict[tuple[int, int], list[int]] = {}
    for c in cfg.cells:
        shapes.setdefault((c.isl, c.osl), []).append(c.concurrency)
    assert shapes == {(1024, 1024): CONCS, (128, 2048): CONCS}
    assert all(c.num_prompts >= c.concurrency for c in cfg.cells)  # at least one full wave
    args = cfg.server_args
    assert args[args.index("--max-num-seqs") + 1] == "128" and args[args.index("--dtype") + 1] == "bfloat16"


def estimated_cell_s(isl: int, osl: int, conc: int, prompts: int, warmups: int) -> float:
    """The script header's model: a wave of B requests takes B*ISL/34k + OSL*(5.0 + 0.075*B) ms;
    warm-ups are waves of min(warm-ups, B) requests with 16 output tokens."""

    def wave(b: int, out: int) -> float:
        return b * isl / 34_000 + out * (5.0 + 0.075 * b) / 1000

    waves = -(-prompts // conc)
    warm_b = min(warmups, conc)
    return waves * wave(conc, osl) + -(-warmups // warm_b) * wave(warm_b, 16)


def test_estimated_sweep_fits_one_device_call():
    # one device call: ~520 s of command, of which server start, checkpoint and stop take ~90 s;
    # the sweep must leave a wide margin for estimates that are off
    cfg = load_sweep_config(CONFIG, "perf")
    warm = cfg.params["num_warmups"]
    total = sum(estimated_cell_s(c.isl, c.osl, c.concurrency, c.num_prompts, warm) for c in cfg.cells)
    assert 150 < total < 300, total
    # each cell ends well inside its client cut-off (client_initial_wait_s + polls)
    cut = cfg.params["client_initial_wait_s"] + cfg.params["client_poll_count"] * cfg.params["client_poll_wait_time"]
    assert max(estimated_cell_s(c.isl, c.osl, c.concurrency, c.num_prompts, warm) for c in cfg.cells) < cut / 2


def _env_with_failing_dmesg(tmp_path: Path) -> dict:
    """A PATH whose dmesg fails as it does in a container (kernel.dmesg_restrict), and no NVML."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "dmesg"
    fake.write_text("#!/bin/sh\necho 'dmesg: read kernel buffer failed: Operation not permitted' >&2\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",  # this tree's atomc
    }


@pytest.mark.slow
def test_tiny_run_end_to_end(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(out), "--tiny"], capture_output=True, text=True, timeout=1200,
        env=_env_with_failing_dmesg(tmp_path), cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "dmesg not readable" in proc.stderr  # warned before the run
    report = json.loads((out / "report.json").read_text())
    assert len(report["cells"]) == 6 and all(c["completed"] == c["num_prompts"] for c in report["cells"].values())
    verdicts = {b["block"]: b["verdict"] for b in report["blocks"]}
    assert verdicts["functional.api_smoke"] == verdicts["functional.health_check"] == "PASS"
    assert verdicts["platform.dmesg_scan"] == "SKIP"  # reported, not a crash
    assert verdicts["platform.gpu_metrics_poll"] in ("SKIP", "PASS")  # PASS where NVML sees a GPU
    assert report["exit_code"] == 0 and report["summary"]["FAIL"] == 0
    deck = json.loads((out / "run_deck.json").read_text())
    assert deck["cells"].keys() == report["cells"].keys()
    html = (out / "run_deck.html").read_text()
    assert html.count('class="chart"') >= 6 and "<script" not in html  # 3 plots per shape, offline
    assert (out / "suite.log").is_file() and (out / "server.log").is_file()
    # the closing summary names every cell, so the tail of the output shows the run
    tail = proc.stdout[-4000:]
    assert all(key in tail for key in report["cells"]) and "exit code: 0" in tail


# the suite's Python, held after its first report.json (before the server starts), so the timeout
# always stops it mid-run: a 10 s timeout alone let a warm tiny suite (compile cache hit) finish first
HELD_SUITE = """#!/usr/bin/env bash
if [[ "$*" == *"bench sweep"* ]]; then
  exec "$REAL_PYTHON" -c '
import runpy, sys, time
from atomc.bench import suite
save = suite.SuiteRun.save
def held(run):
    save(run)
    time.sleep(3600)
suite.SuiteRun.save = held
sys.argv = ["atomc", *sys.argv[1:]]
runpy.run_module("atomc.cli", run_name="__main__")' "${@:3}"
fi
exec "$REAL_PYTHON" "$@"
"""


@pytest.mark.slow
def test_a_suite_stopped_by_the_timeout_still_leaves_a_deck(tmp_path):
    out = tmp_path / "out"
    held = tmp_path / "held_python"
    held.write_text(HELD_SUITE)
    held.chmod(held.stat().st_mode | stat.S_IEXEC)
    env = {**_env_with_failing_dmesg(tmp_path), "SUITE_TIMEOUT_S": "30"}
    env.update(PYTHON=str(held), REAL_PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(SCRIPT), str(out), "--tiny"], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path
    )
    assert proc.returncode == 124, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "report.json").is_file() and (out / "run_deck.html").is_file()
    assert json.loads((out / "report.json").read_text())["finished_at"] is None  # the run did not finish
