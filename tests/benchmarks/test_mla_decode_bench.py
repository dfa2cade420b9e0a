"""benchmarks/mla_decode.py's --tiny mode (the CPU smoke run through the Triton interpreter) runs
and finds the kernel equal to the reference. In a child process: the interpreter setting must
precede triton's first import."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_mode_runs_and_checks_the_kernel():
    pytest.importorskip("triton")
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "mla_decode.py"), "--tiny"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("tiny bs")]
    assert len(rows) == 2 and all("err" in row for row in rows)
