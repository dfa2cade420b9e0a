"""The --tiny modes of benchmarks/decode_attention_short.py, fp8_quant_kernels.py, head_matmul.py and
moe_align.py (the CPU smoke runs through the Triton interpreter): every config of their grids runs,
agrees with the first config's output (the scripts assert it), and lands in the JSON. In child
processes: the interpreter setting must precede triton's first import."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_tiny(script: str, out: Path) -> dict:
    pytest.importorskip("triton")
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--tiny", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


def test_decode_attention_short_tiny(tmp_path):
    rows = run_tiny("decode_attention_short.py", tmp_path / "short.json")["rows"]
    assert {r["kind"] for r in rows} == {"mha", "mla"}
    assert all("error" not in r and r["rel_err_vs_first"] < 1e-5 for r in rows)
    # split with 1- and 4-tile segments, and no split: the one-segment path and the merge both ran
    assert {str(r["config"].get("min_seg_tiles")) for r in rows} == {"1", "4", "None"}


def test_fp8_quant_kernels_tiny(tmp_path):
    rows = run_tiny("fp8_quant_kernels.py", tmp_path / "quant.json")["rows"]
    assert {r["op"].split()[0] for r in rows} == {"rms_norm_quant", "silu_and_mul_quant", "quant_dynamic"}
    assert all(r.get("same_as_default") for r in rows), rows


def test_head_matmul_tiny(tmp_path):
    rows = run_tiny("head_matmul.py", tmp_path / "head.json")["results"]
    # both products, the bmm and every tile of the grid, each checked against the bmm
    assert {r["product"] for r in rows} == {"columns (W_UK)", "rows (W_UV^T)"}
    assert sum(r["config"] == "bmm" for r in rows) == 2 and len(rows) == 6
    assert all(r["rel_err"] < 1e-5 for r in rows)


def test_moe_align_tiny(tmp_path):
    rows = run_tiny("moe_align.py", tmp_path / "align.json")["results"]
    # each size ran both ways and the script found them equal (it exits non-zero where they differ)
    assert [r["tokens"] for r in rows] == [3, 40] and all(r["pairs"] == 2 * r["tokens"] for r in rows)
