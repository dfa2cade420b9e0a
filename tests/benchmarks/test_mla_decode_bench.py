"""benchmarks/mla_decode.py's --tiny mode (the CPU smoke run through the Triton interpreter) runs,
finds the kernel equal to the reference and prints a row's roofline arithmetic. In a child
process: the interpreter setting must precede triton's first import."""

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
    # the GPU rows' arithmetic at V3 widths: 302 MB and 73 GFLOP in 100 us against 4.3 TB/s and
    # 989.4 TFLOP/s (70% of the bandwidth is 74% of the compute-bound roofline), 800 at the GEMM rate
    (check,) = [line for line in proc.stdout.splitlines() if line.startswith("roofline check")]
    assert "70.2% of copy bw" in check and "73.8% of the compute-bound roofline" in check and "91.3%" in check
