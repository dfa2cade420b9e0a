"""benchmarks/gemv_sass.py compiles the one-row GEMVs for sm_90 on a machine without a GPU and
counts each thread's loop instructions per weight byte: the loads are 16-byte vectors in both, no
loop spills, and the FP8 loop's widening of each e4m3 value to fp32 (F2FP, HADD2) costs it
1.5-2x bf16's instructions a byte (what docs/performance.md section 15 points at); the packed-f16
loop does not. In a child process (no interpreter there)."""

from compile_probe import run_probe

PROBE = """
import json, sys
sys.path.insert(0, "benchmarks")
import gemv_sass
print(json.dumps(gemv_sass.report()))
"""


def test_fp8_reduce_loop_costs_more_instructions_a_byte_than_bf16():
    r = run_probe(PROBE)
    bf16, fp8 = r["bf16 reduce"], r["fp8 reduce"]
    for k in (bf16, fp8):
        assert k["spills"] == 0 and k["loop"]["FFMA"] == 32  # 2 rows x 2,048 over 128 threads
    assert bf16["loop"]["LDG"] == 6 and fp8["loop"]["LDG"] == 3  # 16-byte vectors: 64 / 32 weight bytes + x
    assert fp8["loop"].get("F2FP", 0) > 0 and "F2FP" not in bf16["loop"]  # e4m3 -> f16 pairs
    assert 1.5 < fp8["per_weight_byte"] / bf16["per_weight_byte"] < 2.0


def test_packed_f16_loop_runs_bf16s_instructions_a_byte():
    """reduce_f16: one e4m3x2 -> f16x2 convert (F2FP) and one f16x2 FMA (HFMA2) a weight pair, no
    fp32 FMA or widening in the loop: about bf16's count a byte, well under the fp32 loop's."""
    r = run_probe(PROBE)
    bf16, fp8, f16 = r["bf16 reduce"], r["fp8 reduce"], r["fp8 reduce_f16"]
    assert f16["spills"] == 0 and f16["loop"]["LDG"] == 3
    assert f16["loop"]["HFMA2"] >= 16 and "FFMA" not in f16["loop"] and "HADD2" not in f16["loop"]  # 32 bytes a thread
    assert f16["per_weight_byte"] < 0.65 * fp8["per_weight_byte"]
    assert f16["per_weight_byte"] < 1.1 * bf16["per_weight_byte"]
