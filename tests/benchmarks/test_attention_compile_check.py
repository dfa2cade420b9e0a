"""benchmarks/attention_compile_check.py compiles the paged-attention decode kernel for sm_90 on a
machine without a GPU. FP8 pages at 64-key tiles and 4 warps hold their widened operands whole (far
more registers a thread than bf16 pages); 8 warps bring them back near bf16's. FP8 decode's default
(128-key tiles, 4 warps: fastest on an H100) takes the most registers of all, with half the keys'
bytes a tile of bf16's 64. In a child process (no interpreter there)."""

from compile_probe import run_probe

PROBE = """
import json, sys
sys.path.insert(0, "benchmarks")
import attention_compile_check as c
from mla_compile_check import resources
runs = [c.compile_decode(False), c.compile_decode(True), c.compile_decode(True, 4, 64), c.compile_decode(True, 8, 64)]
print(json.dumps([dict(resources(k), warps=w, tile_n=t) for w, t, k in runs]))
"""


def test_fp8_pages_registers_by_tile_and_warps():
    bf16, fp8, fp8_64_4, fp8_64_8 = run_probe(PROBE)
    assert (bf16["tile_n"], bf16["warps"]) == (64, 4) and (fp8["tile_n"], fp8["warps"]) == (128, 4)
    for r in (bf16, fp8, fp8_64_4, fp8_64_8):
        assert r["async_copies"] > 0 and r["mma_sync"] == 2 and 0 < r["registers"] <= 255
    assert fp8_64_8["shared"] < bf16["shared"]  # half the bytes a tile
    assert fp8_64_4["registers"] > 1.5 * bf16["registers"]  # what 4 warps cost over FP8 pages
    assert fp8_64_8["registers"] <= 1.2 * bf16["registers"] and fp8_64_8["spill_bytes"] == 0
    assert fp8["registers"] >= fp8_64_4["registers"]  # twice the keys a step on the same warps
