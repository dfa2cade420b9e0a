"""benchmarks/tune_moe.py: which tile a bucket keeps, and its --tiny run (the Triton interpreter, a
toy shape, one tile of each grid) writing the file moe_config reads."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_a_bucket_keeps_the_current_tile_unless_beaten():
    tune_moe = pytest.importorskip("tune_moe")
    current, default = (10.0, {"tile": "current"}), (12.0, {"tile": "default"})
    assert tune_moe.choose(current, default, [(10.0, {"tile": "tie"}), (11.0, {})])[1] == {"tile": "current"}
    assert tune_moe.choose(current, default, [(9.5, {"tile": "faster"})])[1] == {"tile": "faster"}
    # a stale file slower than the default gives way to it
    assert tune_moe.choose((13.0, {"tile": "stale"}), default, [])[1] == {"tile": "default"}


def run(*args: str) -> subprocess.CompletedProcess:
    pytest.importorskip("triton")
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "tune_moe.py"), "--tiny", "--shapes", "toy", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


def test_tiny_run_writes_a_file_moe_config_reads(tmp_path):
    proc = run("--tokens", "1,3", "--out-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = tmp_path.glob("*.json")
    assert path.name == "E=4,H=32,I=32,topk=2,dtype=float32,device=cpu.json"
    data = json.loads(path.read_text())
    assert data["meta"]["device"] == "cpu" and list(data["buckets"]) == ["1", "3"]
    for cfg in data["buckets"].values():
        assert cfg["path"] in ("gemv", "small", "sorted") and {"block_n", "block_k"} <= cfg["gate_up"].keys()
    from atomc.kernels.triton import moe_config

    assert moe_config.load_configs(path.name.split("device=")[0], "cpu", directory=tmp_path) == {
        int(m): cfg for m, cfg in data["buckets"].items()
    }
    # --merge keeps the buckets this run does not tune
    proc = run("--tokens", "1", "--merge", "--out-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list(json.loads(path.read_text())["buckets"]) == ["1", "3"]


def test_tiny_refuses_the_shipped_configs_folder():
    proc = run("--tokens", "1")
    assert proc.returncode != 0 and "give --out-dir" in proc.stderr
