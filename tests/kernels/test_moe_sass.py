"""What the H200 will execute in the MXFP4 MoE loops, checked on any machine: benchmarks/moe_sass.py
compiles the kernels for sm_90 with the triton wheel's ptxas and reads their SASS. The first MXFP4
kernels were 2-10x slower than bf16 on the H200 because each value cost a scale gather, an exp2
(MUFU) and int-to-float conversions (I2F): none may come back; the loops may not spill, the GEMV
step stays a handful of loads (16-byte weights, one scale byte, vectorised inputs), and the sorted
route keeps its wgmma (HGMMA) and cp.async (LDGSTS) pipeline. Runs in a subprocess: other kernel
test files set TRITON_INTERPRET=1 process-wide, which replaces compiled kernels with interpreted ones."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
triton = pytest.importorskip("triton")
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@pytest.fixture(scope="module")
def report() -> dict:
    if not (BIN / "ptxas").is_file() or not (BIN / "nvdisasm").is_file():
        pytest.skip("the triton wheel has no NVIDIA ptxas / nvdisasm")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # as the JIT compiles them (fp fusion on)
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "moe_sass.py"), "--json"], env=env,
                         capture_output=True, text=True, timeout=900, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "kernel",
    ["mxfp4_gate_up_gemv", "mxfp4_down_combine_gemv", "mxfp4_gate_up_gemv_packed", "mxfp4_down_combine_gemv_packed",
     "fp8_gate_up_gemv", "fp8_gate_up_gemv_packed", "fp8_block_gate_up_gemv", "fp8_block_gate_up_gemv_packed",
     "mxfp4_gate_up_sorted"],
)  # fmt: skip
def test_no_transcendental_or_conversion_per_value_and_no_spills(report, kernel):
    r = report[kernel]
    assert r["loop"], f"no loop found in {kernel}'s SASS"
    slow = {op: n for op, n in r["loop"].items() if op.startswith(("MUFU", "I2F", "F2I"))}
    assert not slow, slow
    assert r["spills"] == 0


def test_the_one_token_step_is_a_few_vector_loads(report):
    """Gate/up step of a thread: 2 x 16 weight bytes, 2 scale bytes, its 32 inputs (the old kernel: 26
    loads for 16 bytes)."""
    loop = report["mxfp4_gate_up_gemv"]["loop"]
    assert loop.get("LDG", 0) <= 8, loop
    assert sum(loop.values()) < 800, sum(loop.values())  # 538 now; the old kernel: 864 for half the bytes


def test_the_sorted_route_runs_wgmma_on_a_cp_async_pipeline(report):
    loop = report["mxfp4_gate_up_sorted"]["loop"]
    assert loop.get("HGMMA", 0) > 0 and loop.get("LDGSTS", 0) > 0, loop


@pytest.mark.parametrize("kernel", ["mxfp4_gate_up_gemv", "mxfp4_down_combine_gemv"])
def test_the_packed_step_is_f16_pairs_at_half_the_instructions(report, kernel):
    """mxfp4_packed.py: a thread's 32 (gate/up) or 16 (down) weight bytes a step are 8 or 4 words,
    four f16x2 FMAs a word (HFMA2, the PTX `fma.rn.f16x2`), no fp32 multiply-add per value; at most
    about half the fp32 step's instructions (265 against 538 for gate/up when written)."""
    packed, fp32 = report[f"{kernel}_packed"]["loop"], report[kernel]["loop"]
    words = 8 if "gate_up" in kernel else 4
    assert packed.get("HFMA2", 0) >= 4 * words, packed
    assert packed.get("FFMA", 0) <= 4 and packed.get("FMUL", 0) <= 8, packed  # per group / per x value only
    assert sum(packed.values()) < 0.6 * sum(fp32.values()), (sum(packed.values()), sum(fp32.values()))


def test_the_packed_fp8_expert_step_is_f16_pairs(report):
    """moe_gemv.py's packed loop for per-row FP8 experts: a thread's 2 x 16 weight bytes a step are
    16 f16x2 FMAs after e4m3x2 -> f16x2 converts, no fp32 widening (HADD2), multiply-add or scale
    multiply per value: 87 instructions against the dequantising loop's 226 when written."""
    packed, fp32 = report["fp8_gate_up_gemv_packed"]["loop"], report["fp8_gate_up_gemv"]["loop"]
    assert packed.get("HFMA2", 0) >= 16 and "FFMA" not in packed and "HADD2" not in packed, packed
    assert sum(packed.values()) < 0.5 * sum(fp32.values()), (sum(packed.values()), sum(fp32.values()))


def test_the_packed_block_fp8_step_folds_the_scales_into_x(report):
    """The packed loop for block-FP8 experts: the 128-column scales (times the range shift) multiply
    x, one multiply an x value for each of the gate and up row blocks, so the weights take the same
    16 f16x2 FMAs as per-row scales, no fp32 widening or multiply-add a weight: 118 instructions
    against the dequantising loop's 237 when written."""
    packed, fp32 = report["fp8_block_gate_up_gemv_packed"]["loop"], report["fp8_block_gate_up_gemv"]["loop"]
    assert packed.get("HFMA2", 0) >= 16 and "FFMA" not in packed and "HADD2" not in packed, packed
    assert packed.get("FMUL", 0) <= 24, packed  # 2 x 8 x values a thread (+ the scale loads' few)
    assert sum(packed.values()) < 0.6 * sum(fp32.values()), (sum(packed.values()), sum(fp32.values()))


def test_block_fp8_sorted_tile_fits_shared_memory(report):
    """The block-FP8 experts' tile for many rows an expert (128 x 128 x 64, 3 stages) once gathered
    a per-element fp32 scale tile a stage: 240 KiB of shared memory, over sm_90's 227, so
    DeepSeek-V3's FP8 layers failed to launch. A tile of <= 128 columns loads one scale a row."""
    r = report["fp8_block_gate_up_sorted"]
    assert r["smem"] <= 160 * 1024, r["smem"]
    assert r["spills"] == 0 and r["loop"].get("HGMMA", 0) > 0, r


@pytest.mark.parametrize("kernel", ["fp8_block_gate_up_small_a8", "fp8_channel_gate_up_small_a8"])
def test_a8_small_route_compiles_to_a_tensor_core_loop(report, kernel):
    """The `a8` tiles (x quantised to e4m3 in the kernel) compile for sm_90 without spills, their dot
    on the tensor cores; at 16 rows Triton upcasts both e4m3 operands to f16 for mma.sync (HMMA),
    so the weights skip only the dequantising loop's scale multiply and bf16 rounding."""
    r = report[kernel]
    assert r["spills"] == 0 and r["loop"].get("HMMA", 0) > 0, r


def test_the_in_kernel_combine_leaves_the_down_loop_as_it_was(report):
    # COMBINE_LAST adds work after the K loop only (an arrival, the last program's weighted sum)
    plain, combined = report["down_small"], report["down_small_combine_last"]
    assert combined["spills"] == 0 and combined["regs"] <= plain["regs"] + 8
    assert combined["loop"].get("HMMA") == plain["loop"].get("HMMA") > 0
