"""benchmarks/attention_compile_check.py compiles the paged-attention decode kernel for sm_90 on a
machine without a GPU: FP8 pages at 4 warps hold their widened operands whole (far more registers
a thread than bf16 pages), and the default for FP8 pages (8 warps) brings them back near bf16's.
In a child process (no interpreter there)."""

from compile_probe import run_probe

PROBE = """
import json, sys
sys.path.insert(0, "benchmarks")
import attention_compile_check as c
from mla_compile_check import resources
runs = [c.compile_decode(False), c.compile_decode(True), c.compile_decode(True, 4)]
print(json.dumps([dict(resources(k), warps=w) for w, k in runs]))
"""


def test_fp8_pages_default_warps_keep_registers_near_bf16():
    bf16, fp8, fp8_4 = run_probe(PROBE)
    assert bf16["warps"] == 4 and fp8["warps"] == 8
    for r in (bf16, fp8, fp8_4):
        assert r["async_copies"] > 0 and r["mma_sync"] == 2 and 0 < r["registers"] <= 255
    assert fp8["shared"] < bf16["shared"]  # half the bytes a tile
    assert fp8_4["registers"] > 1.5 * bf16["registers"]  # what 4 warps cost over FP8 pages
    assert fp8["registers"] <= 1.2 * bf16["registers"] and fp8["spill_bytes"] == 0
