"""The PDL kernels as the H200 gets them, checked on any machine: a subprocess compiles a few of them
for sm_90 with the triton wheel's ptxas (off the interpreter, which other kernel tests turn on
process-wide) and reads the PTX. With PDL on each has one `griddepcontrol.wait` and one
`griddepcontrol.launch_dependents`, the GEMVs (bf16 reduce, FP8 dot) and the norm issue their first
weight loads before the wait, and with PDL off neither instruction is there."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
triton = pytest.importorskip("triton")
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from atomc.kernels.triton.fp8_gemv import _fp8_gemv_dot_kernel
from atomc.kernels.triton.gemv import _gemv_reduce_kernel
from atomc.kernels.triton.moe_align import _align_kernel
from atomc.kernels.triton.moe_gemv import moe_gate_up_gemv_kernel
from atomc.kernels.triton.moe_mxfp4_gemv import mxfp4_down_combine_gemv_kernel
from atomc.kernels.triton.rmsnorm import _rms_norm_kernel

FP8_DOT = dict(x_ptr="*fp8e4nv", xs_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32", b_ptr="*bf16", y_ptr="*bf16",
               N="i32", K="i32", k_per_split="i32", stride_wn="i32", stride_wsn="i32", SCALE_ROWS="i32")
KERNELS = {
    "fp8_dot_gemv": (_fp8_gemv_dot_kernel, FP8_DOT, dict(WS_ROWS=True, BLOCK_SCALES=False, HAS_BIAS=False,
                     ATOMIC=False, EVEN_K=True, GROUP_K=256, BLOCK_N=32, BLOCK_K=256)),
    "fp8_block_dot_gemv": (_fp8_gemv_dot_kernel, FP8_DOT, dict(WS_ROWS=True, BLOCK_SCALES=True, HAS_BIAS=False,
                           ATOMIC=True, EVEN_K=False, GROUP_K=128, BLOCK_N=16, BLOCK_K=128)),
    "gemv": (_gemv_reduce_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16", y_ptr="*bf16", N="i32",
             K="i32", stride_wn="i32"), dict(HAS_BIAS=False, BLOCK_N=2, BLOCK_K=1024)),
    "rms_norm": (_rms_norm_kernel, dict(x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16",
                 res_out_ptr="*bf16", stride_x="i32", stride_r="i32", stride_o="i32", stride_ro="i32",
                 n_cols="i32", eps="fp32"), dict(ADD=True, BLOCK_N=2048)),
    "moe_align": (_align_kernel, dict(local_ptr="*i32", sorted_ptr="*i32", block_expert_ptr="*i32",
                  num_padded_ptr="*i32", P="i32", ROWS="i32", NUM_BLOCKS="i32", BLOCK_M="i32"),
                  dict(E=128, BINS=256, CHUNK=64, COUNT=1024, FILL_E=16, PAD_STEP=16, RUN_STEP=64, TAIL=1024,
                       GATHER=False)),
    "moe_gate_up_gemv": (moe_gate_up_gemv_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", s_ptr="*bf16",
                         b_ptr="*bf16", act_ptr="*bf16", local_ids="*i32", H="i32", INTER="i32",
                         stride_we="i32", stride_wn="i32", stride_se="i32", stride_sn="i32", stride_sk="i32",
                         stride_be="i32", stride_am="i32", alpha="fp32", limit="fp32"),
                         dict(ACT=0, HAS_BIAS=False, WEIGHTS=0, BLOCK_N=4, BLOCK_K=512, PACKED=False, X_TOP=0)),
    "mxfp4_down_combine_gemv": (mxfp4_down_combine_gemv_kernel, dict(act_ptr="*bf16", w_ptr="*u8", s_ptr="*u8",
                                b_ptr="*bf16", weights_ptr="*fp32", local_ids="*i32", out_ptr="*bf16", H="i32",
                                INTER="i32", stride_am="i32", stride_we="i32", stride_wn="i32", stride_se="i32",
                                stride_sn="i32", stride_be="i32", stride_om="i32"),
                                dict(TOPK=4, HAS_BIAS=True, BLOCK_N=4, BLOCK_K=1024, PACKED=False, ASM=False)),
}
KERNELS["mxfp4_down_combine_gemv_packed"] = (
    mxfp4_down_combine_gemv_kernel, KERNELS["mxfp4_down_combine_gemv"][1],
    dict(KERNELS["mxfp4_down_combine_gemv"][2], PACKED=True, ASM=True),
)
KERNELS["moe_align_gather"] = (  # GATHER_PICK: tl.gather places the pairs, 128 a chunk at 257 experts
    _align_kernel, KERNELS["moe_align"][1], dict(KERNELS["moe_align"][2], E=257, BINS=512, CHUNK=128, GATHER=True),
)
out = {}
for name, (fn, sig, cx) in KERNELS.items():
    for pdl in (True, False):
        c = {**cx, "PDL": pdl}
        names = list(fn.arg_names)
        aligned = {(i,): [["tt.divisibility", 16]] for i, (k, v) in enumerate(sig.items()) if v.startswith("*")}
        src = ASTSource(fn=fn, signature={**sig, **dict.fromkeys(c, "constexpr")},
                        constexprs={(names.index(k),): v for k, v in c.items()}, attrs=aligned)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=4, num_stages=3, launch_pdl=pdl))
        assert k.asm["cubin"]  # ptxas took it
        ops = [l.strip().split()[0] if not l.strip().startswith("@") else l.strip().split()[1]
               for l in k.asm["ptx"].splitlines() if "griddepcontrol" in l or "ld.global" in l]
        out[f"{name} {'on' if pdl else 'off'}"] = ops
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ptx() -> dict:
    if not (BIN / "ptxas").is_file():
        pytest.skip("the triton wheel has no NVIDIA ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                         cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "kernel",
    ["gemv", "fp8_dot_gemv", "fp8_block_dot_gemv", "rms_norm", "moe_gate_up_gemv", "mxfp4_down_combine_gemv",
     "mxfp4_down_combine_gemv_packed", "moe_align", "moe_align_gather"],
)  # fmt: skip
def test_one_wait_and_one_release_with_pdl_and_none_without(ptx, kernel):
    on, off = ptx[f"{kernel} on"], ptx[f"{kernel} off"]
    assert on.count("griddepcontrol.wait") == 1 and on.count("griddepcontrol.launch_dependents") == 1, on
    assert on.index("griddepcontrol.wait") < on.index("griddepcontrol.launch_dependents")
    assert not any(op.startswith("griddepcontrol") for op in off), off


@pytest.mark.parametrize("kernel", ["gemv", "fp8_dot_gemv", "fp8_block_dot_gemv", "rms_norm"])
def test_weights_stream_in_before_the_wait(ptx, kernel):
    on = ptx[f"{kernel} on"]
    assert any(op.startswith("ld.global") for op in on[: on.index("griddepcontrol.wait")]), on
