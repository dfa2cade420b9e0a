"""benchmarks/mla_compile_check.py compiles the Triton MLA kernel for sm_90 on a machine without
a GPU: the new default tiles become warpgroup MMAs fed by async copies within an H200's shared
memory (over a bf16 and over an e4m3 latent cache), the tiling before stays on mma.sync. In a
child process (no interpreter there)."""

from compile_probe import run_probe

PROBE = """
import json, sys
sys.path.insert(0, "benchmarks")
import mla_compile_check as c
from mla_decode import NEW, OLD
configs = [c.compile_config(NEW), c.compile_config(OLD), c.compile_config(NEW, fp8=True)]
print(json.dumps([c.resources(k) for k in configs]))
"""


def test_default_tiles_compile_to_warpgroup_mmas():
    new, old, fp8 = run_probe(PROBE)
    assert new["wgmma"] >= 3 and new["mma_sync"] == 0 and new["async_copies"] > 0
    assert new["shared"] <= 227 * 1024 and 0 < new["registers"] <= 255
    assert [4, 2] in new["mma_warps"]  # the PV accumulator split over two warpgroups
    assert old["wgmma"] == 0 and old["mma_sync"] == 3  # 32-row tiles: below a warpgroup MMA's 64
    # over an e4m3 latent cache the widened tiles still feed warpgroup MMAs, in less shared memory
    assert fp8["wgmma"] >= 3 and fp8["mma_sync"] == 0 and fp8["async_copies"] > 0
    assert fp8["shared"] < new["shared"] and 0 < fp8["registers"] <= 255
