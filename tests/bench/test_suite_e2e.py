"""`atomc bench sweep` end to end against `atomc serve` on a tiny model on the CPU: the suite starting
its own server with functional, platform and mtp_quality blocks, and a schema_version 2 file's
profiles run against a server the user started (--base-url, and the sglang driver's params)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from atomc.bench.cli import bench_app
from atomc.bench.thresholds import GATED_METRICS

REPO = Path(__file__).resolve().parents[2]
SERVER_ARGS = ["--device", "cpu", "--enforce-eager", "--num-kv-blocks", "64"]
VOCAB = "384"  # the tiny checkpoints' vocabulary (conftest.VOCAB); their model card names none
TINY_SWEEP = {
    "sequence_combinations": [{"name": "tiny", "isl": "16", "osl": "4"}],
    "runs": [{"combo": "tiny", "concurrency": 1}, {"combo": "tiny", "concurrency": 2}],
}
CELLS = ["ISL=16,OSL=4,TP=1,PP=1,CONC=1", "ISL=16,OSL=4,TP=1,PP=1,CONC=2"]
# small waits so a hung server or client fails the test in minutes, not CVS's hours
WAITS = {"server_ready_timeout_s": "300", "client_initial_wait_s": "120", "client_poll_count": "1",
         "client_poll_wait_time": "60"}  # fmt: skip


def loose_thresholds() -> dict:
    """Every gated metric of each cell: health gated, the rest recorded (kind info)."""
    gated = {"success_rate": {"kind": "min", "value": 1}, "failed": {"kind": "max", "value": 0},
             "output_throughput": {"kind": "min_tok_s", "value": 0.01}}  # fmt: skip
    return {key: {m: gated.get(m, {"kind": "info"}) for m in GATED_METRICS} for key in CELLS}


def run_cli(*args, env=None):
    return CliRunner().invoke(bench_app, ["sweep", "--disable-tqdm", "--vocab-size", VOCAB, *args], env=env)


def test_suite_starts_atomc_serve_and_runs_the_blocks(llama_dir, tmp_path):
    config = {
        "_comment": "the suite starts atomc serve itself (driver atom)",
        "schema_version": 1,
        "framework": "atom",
        "enforce_thresholds": True,
        "threshold_json": "tiny_threshold.json",
        "model": {"id": str(llama_dir)},
        "roles": {"server": {"atom_args": SERVER_ARGS}},
        "params": {"driver": "atom", "num_prompts": "2", "max_model_length": "128", "metric_percentiles": "50,99",
                   "bench_max_failed_requests": "0", **WAITS},
        "functional": {"api_smoke": True, "health_check": True},
        "platform": {"dmesg_scan": True, "gpu_metrics_poll": {"interval_s": 0.2}},
        "mtp_quality": {"enabled": True, "chat_template_prompt": "Say hello."},
        "sweep": TINY_SWEEP,
    }  # fmt: skip
    thresholds = loose_thresholds() | {"mtp_quality": {"mtp.acceptance_rate": {"kind": "min", "value": 0.5}}}
    (tmp_path / "tiny_single.json").write_text(json.dumps(config))
    (tmp_path / "tiny_threshold.json").write_text(json.dumps(thresholds))
    out = tmp_path / "out"
    result = run_cli("--config", str(tmp_path / "tiny_single.json"), "--output-dir", str(out))
    assert result.exit_code == 0, result.output + (out / "server.log").read_text()[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["server_started"] is True and report["driver"] == "atom" and report["profile"] == "perf"
    assert list(report["cells"]) == CELLS
    for cell in report["cells"].values():
        assert cell["completed"] == 2 and cell["failed"] == 0
        assert cell["p50_ttft_ms"] is not None  # params.metric_percentiles honoured
    verdicts = {b["block"]: (b["verdict"], b["reason"]) for b in report["blocks"]}
    assert list(verdicts) == ["functional.health_check", "functional.api_smoke", "platform.dmesg_scan",
                              "platform.gpu_metrics_poll", "mtp_quality"]  # fmt: skip
    assert verdicts["functional.health_check"][0] == "PASS" and verdicts["functional.api_smoke"][0] == "PASS"
    assert verdicts["platform.dmesg_scan"][0] in ("PASS", "SKIP")  # SKIP where the kernel log is not readable
    assert verdicts["platform.gpu_metrics_poll"][0] in ("PASS", "SKIP")  # SKIP without NVML / amd-smi
    assert verdicts["mtp_quality"] == (
        "SKIP",
        "the server exports no speculative-decoding metrics (*:spec_decode_*); atomc has no speculative decoding yet",
    )
    gates = {(g["cell"], g["metric"]): g for g in report["gates"]}
    assert gates[("mtp_quality", "mtp.acceptance_rate")]["status"] == "SKIP"  # not produced: skipped, reported
    assert gates[(CELLS[0], "success_rate")]["status"] == "PASS"
    assert report["exit_code"] == 0 and report["summary"]["FAIL"] == 0
    assert "server ready at" in result.output


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def running_server(tmp_path_factory, checkpoints):
    """An `atomc serve` started the way a user would, for --base-url runs."""
    port = free_port()
    cmd = [sys.executable, "-m", "atomc.cli", "serve", "--model", str(checkpoints["llama"]), "--port", str(port),
           "--max-model-len", "128", *SERVER_ARGS]  # fmt: skip
    log = tmp_path_factory.mktemp("srv") / "server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.3)
        yield url, port
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def profiles_config(port: int) -> dict:
    params = {"num_prompts": "2", "tensor_parallelism": "1", "metric_percentiles": "95,99", **WAITS}
    return {
        "schema_version": 2,
        "framework": "atom",
        "default_profile": "perf",
        "paths": {"shared_fs": "/tmp/{user-id}", "log_dir": "{shared_fs}/LOGS"},
        "model": {"id": None},
        "profiles": {
            "perf": {"enforce_thresholds": True, "params": {"driver": "atom", **params},
                     "functional": {"health_check": True}, "sweep": TINY_SWEEP},
            "mtp3": {"enforce_thresholds": False,
                     "params": {"driver": "atom", **params, "reuse_server_across_sweep": "false"},
                     "mtp_quality": {"enabled": True}, "functional": {"api_smoke": True}, "sweep": TINY_SWEEP},
            "sglang": {"enforce_thresholds": False,
                       "params": {"driver": "sglang", "base_url": "http://127.0.0.1", "port_no": str(port), **params},
                       "sweep": TINY_SWEEP},
        },
    }  # fmt: skip


def test_profiles_against_a_server_the_user_started(running_server, tmp_path):
    url, port = running_server
    (tmp_path / "tiny_profiles.json").write_text(json.dumps(profiles_config(port)))
    (tmp_path / "tiny_profiles_threshold.json").write_text(
        json.dumps({"profiles": {"perf": loose_thresholds(), "mtp3": {}, "sglang": {}}})
    )
    config = str(tmp_path / "tiny_profiles.json")

    perf = run_cli("--config", config, "--base-url", url, "--output-dir", str(tmp_path / "perf"))
    assert perf.exit_code == 0, perf.output
    report = json.loads((tmp_path / "perf" / "report.json").read_text())
    assert report["profile"] == "perf" and report["server_started"] is False and report["base_url"] == url
    assert report["threshold_file"].endswith("tiny_profiles_threshold.json")  # the only one in the folder
    assert [b["verdict"] for b in report["blocks"]] == ["PASS"]
    assert {g["status"] for g in report["gates"]} == {"PASS", "INFO"}

    mtp = run_cli("--config", config, "--base-url", url, "--output-dir", str(tmp_path / "mtp3"),
                  env={"CVS_CONFIG_PROFILE": "mtp3"})  # fmt: skip
    assert mtp.exit_code == 0, mtp.output
    report = json.loads((tmp_path / "mtp3" / "report.json").read_text())
    assert report["profile"] == "mtp3"
    assert [b["block"] for b in report["blocks"]] == ["functional.api_smoke", "mtp_quality"]
    assert report["blocks"][1]["verdict"] == "SKIP"
    assert any("reuse_server_across_sweep=false has no effect" in n for n in report["notes"])

    # the sglang driver: no --base-url, the server named by params.base_url + port_no is used as is
    sglang = run_cli("--config_file", config, "--config_profile", "sglang", "--output-dir", str(tmp_path / "sg"))
    assert sglang.exit_code == 0, sglang.output
    assert f"driver sglang: atomc starts no sglang server; using the one you started at {url}" in sglang.output
    report = json.loads((tmp_path / "sg" / "report.json").read_text())
    assert report["driver"] == "sglang" and report["cells"][CELLS[1]]["completed"] == 2
