"""The quantised MoE kernels compiled for the H200 (sm_90) on any machine, no GPU needed: each
kernel's registers, spills, shared memory and the opcodes of its main loop, from the SASS of
Triton's own ptxas / nvdisasm (shipped in the triton wheel).

    python benchmarks/moe_sass.py [--json]

Why: on a CPU-only machine this is the only look at what a kernel will execute. The first MXFP4
MoE was slow on the H200 for reasons visible here (per-value scale loads, exp2 on the MUFU unit,
int-to-float conversions); tests/kernels/test_moe_sass.py keeps them out of the MXFP4 loops.
Arguments are specialised as the JIT would for 16-byte-aligned tensors and strides. The loop is
the SASS between the kernel's first loop label and its backward branch; `--json` prints
{kernel: {"regs", "spills", "smem", "loop": {opcode: count}}} (opcodes without modifiers).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not interpreted ones
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from atomc.kernels.triton.moe_gemm import moe_down_kernel, moe_gate_up_kernel  # noqa: E402
from atomc.kernels.triton.moe_gemv import moe_gate_up_gemv_kernel  # noqa: E402
from atomc.kernels.triton.moe_mxfp4_gemv import mxfp4_down_combine_gemv_kernel, mxfp4_gate_up_gemv_kernel  # noqa: E402
from atomc.kernels.triton.moe_tiles import FP8_BLOCK, FP8_ROW, MXFP4  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
ROUTE = dict(local_ids="*i32", sorted_ids="*i32", block_expert="*i32", num_padded="*i32", P="i32", H="i32", INTER="i32")
# moe_gemm's gate/up kernel, bf16 activations; the weight and scale pointers by format
SORTED_GATE_UP = dict(x_ptr="*bf16", w_ptr=None, s_ptr=None, b_ptr="*bf16", act_ptr="*bf16", **ROUTE, stride_xm="i32",
                      stride_we="i32", stride_wn="i32", stride_se="i32", stride_sn="i32", stride_sk="i32",
                      stride_be="i32", stride_am="i32", alpha="fp32", limit="fp32")  # fmt: skip
# Qwen3-30B-A3B's per-row FP8 experts (weight-only: bf16 activations)
FP8_GATE_UP = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*fp32", b_ptr="*bf16", act_ptr="*bf16", local_ids="*i32",
                   H="i32", INTER="i32", stride_we="i32", stride_wn="i32", stride_se="i32", stride_sn="i32",
                   stride_sk="i32", stride_be="i32", stride_am="i32", alpha="fp32", limit="fp32")  # fmt: skip
# GPT-OSS-20B's MXFP4 experts, bf16 activations
MXFP4_GATE_UP = dict(x_ptr="*bf16", w_ptr="*u8", s_ptr="*u8", b_ptr="*bf16", act_ptr="*bf16", local_ids="*i32",
                     H="i32", INTER="i32", stride_we="i32", stride_wn="i32", stride_se="i32", stride_sn="i32",
                     stride_be="i32", stride_am="i32", alpha="fp32", limit="fp32", stride_xm="i32")  # fmt: skip
MXFP4_DOWN = dict(act_ptr="*bf16", w_ptr="*u8", s_ptr="*u8", b_ptr="*bf16", weights_ptr="*fp32", local_ids="*i32",
                  out_ptr="*bf16", H="i32", INTER="i32", stride_am="i32", stride_we="i32", stride_wn="i32",
                  stride_se="i32", stride_sn="i32", stride_be="i32", stride_om="i32")  # fmt: skip
GATE_UP_TILE = dict(ACT=1, HAS_BIAS=True, BLOCK_N=4, BLOCK_K=1024, PDL=False, TOPK=4)
DOWN_TILE = dict(TOPK=4, HAS_BIAS=True, BLOCK_N=4, BLOCK_K=1024, PDL=False)
FP8_TILE = dict(ACT=0, HAS_BIAS=False, WEIGHTS=1, BLOCK_N=2, BLOCK_K=1024, PDL=False)
# moe_gemm's gate/up on e4m3 experts (DeepSeek-V3's top 8, SiLU, no bias), the small route's 16-row
# tile of FP8_ONE_TOKEN's gate/up (32 x 128) in block FP8
FP8_SORTED_GATE_UP = dict(SORTED_GATE_UP, w_ptr="*fp8e4nv", s_ptr="*fp32")
FP8_SMALL = dict(TOPK=8, ACT=0, HAS_BIAS=False, ROUTE_SORTED=False, IEEE=False, WEIGHTS=FP8_BLOCK, BLOCK_M=16,
                 BLOCK_N=32, BLOCK_K=128, BLOCK_SLOTS=8, PDL=False)  # fmt: skip
# moe_gemm's down kernel on the small route at one token, bf16 experts (Qwen3-30B-A3B's top 8),
# with the combine inside (COMBINE_LAST: moe.COMBINE_IN_DOWN_ONE_TOKEN) and without
SMALL_DOWN = dict(act_ptr="*bf16", w_ptr="*bf16", s_ptr="*bf16", b_ptr="*bf16", y_ptr="*bf16", **ROUTE,
                  stride_am="i32", stride_we="i32", stride_wn="i32", stride_se="i32", stride_sn="i32",
                  stride_sk="i32", stride_be="i32", stride_ym="i32", weights_ptr="*fp32", out_ptr="*bf16",
                  counter_ptr="*i32")  # fmt: skip
SMALL_DOWN_TILE = dict(TOPK=8, HAS_BIAS=False, ROUTE_SORTED=False, IEEE=False, WEIGHTS=0, BLOCK_M=16, BLOCK_N=64,
                       BLOCK_K=128, BLOCK_SLOTS=8, PDL=True, A8=False)  # fmt: skip
# name: (kernel, signature, constexprs, num_warps, num_stages)
KERNELS = {
    "mxfp4_gate_up_gemv": (mxfp4_gate_up_gemv_kernel, MXFP4_GATE_UP, dict(GATE_UP_TILE, PACKED=False, ASM=False), 4, 4),
    "mxfp4_down_combine_gemv": (mxfp4_down_combine_gemv_kernel, MXFP4_DOWN, dict(DOWN_TILE, PACKED=False, ASM=False),
                                4, 4),
    "mxfp4_gate_up_gemv_packed": (mxfp4_gate_up_gemv_kernel, MXFP4_GATE_UP, dict(GATE_UP_TILE, PACKED=True, ASM=True),
                                  4, 4),
    "mxfp4_down_combine_gemv_packed": (mxfp4_down_combine_gemv_kernel, MXFP4_DOWN,
                                       dict(DOWN_TILE, PACKED=True, ASM=True), 4, 4),
    "fp8_gate_up_gemv": (moe_gate_up_gemv_kernel, FP8_GATE_UP, dict(FP8_TILE, PACKED=False, X_TOP=0), 4, 4),
    "fp8_gate_up_gemv_packed": (moe_gate_up_gemv_kernel, FP8_GATE_UP, dict(FP8_TILE, PACKED=True, X_TOP=6), 4, 4),
    # DeepSeek-V3's block-FP8 experts at one token, the default tile: the dequantising loop, and
    # the packed one with the scales folded into x
    "fp8_block_gate_up_gemv": (moe_gate_up_gemv_kernel, FP8_GATE_UP,
                               dict(FP8_TILE, WEIGHTS=FP8_BLOCK, PACKED=False, X_TOP=0), 4, 4),
    "fp8_block_gate_up_gemv_packed": (moe_gate_up_gemv_kernel, FP8_GATE_UP,
                                      dict(FP8_TILE, WEIGHTS=FP8_BLOCK, PACKED=True, X_TOP=3), 4, 4),
    "mxfp4_gate_up_sorted": (moe_gate_up_kernel, dict(SORTED_GATE_UP, w_ptr="*u8", s_ptr="*u8"),
        dict(TOPK=4, ACT=1, HAS_BIAS=True, ROUTE_SORTED=True, IEEE=False, WEIGHTS=MXFP4, BLOCK_M=64, BLOCK_N=64,
             BLOCK_K=128, BLOCK_SLOTS=4, PDL=False, A8=False), 4, 3),
    # FP8 experts at one token on the small route (moe_config.FP8_ONE_TOKEN's gate/up tile, block_k
    # 128): the weights dequantised before a bf16 dot, or with `a8` raw into an e4m3 dot
    "fp8_block_gate_up_small": (moe_gate_up_kernel, FP8_SORTED_GATE_UP, dict(FP8_SMALL, A8=False), 4, 3),
    "fp8_block_gate_up_small_a8": (moe_gate_up_kernel, FP8_SORTED_GATE_UP, dict(FP8_SMALL, A8=True), 4, 3),
    "fp8_channel_gate_up_small_a8": (moe_gate_up_kernel, FP8_SORTED_GATE_UP, dict(FP8_SMALL, WEIGHTS=FP8_ROW, A8=True),
                                     4, 3),
    "down_small": (moe_down_kernel, SMALL_DOWN, dict(SMALL_DOWN_TILE, COMBINE_LAST=False), 4, 3),
    "down_small_combine_last": (moe_down_kernel, SMALL_DOWN, dict(SMALL_DOWN_TILE, COMBINE_LAST=True), 4, 3),
    # DeepSeek-V3's block-FP8 experts on the default tile for many rows an expert (moe_config)
    "fp8_block_gate_up_sorted": (moe_gate_up_kernel, FP8_SORTED_GATE_UP,
        dict(FP8_SMALL, ROUTE_SORTED=True, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, A8=False), 8, 3),
}  # fmt: skip


def compile_sm90(
    fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int, aligned_ints=("stride", "H", "INTER")
) -> dict:
    """`aligned_ints`: the integer arguments (by name prefix) the JIT would see divisible by 16."""
    aligned = {(i,): [["tt.divisibility", 16]] for i, (k, v) in enumerate(signature.items())
               if v.startswith("*") or k.startswith(aligned_ints)}  # fmt: skip
    names = list(fn.arg_names)
    src = ASTSource(fn=fn, signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
                    constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=aligned)  # fmt: skip
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([BIN / "nvdisasm", "-c", cubin], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([BIN / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    spills = re.search(r"LOCAL:(\d+)", usage)
    return {"regs": int(regs[1]) if regs else None, "spills": int(spills[1]) if spills else None,
            "smem": kernel.metadata.shared, "loop": loop_opcodes(sass)}  # fmt: skip


def loop_opcodes(sass: str) -> dict[str, int]:
    """Opcode counts of the main loop (from a label to the branch back to it): the one with the most
    multiply-adds (FFMA, HFMA2, HGMMA), then the longest; the packed kernels run a pass over x (max
    only) before theirs."""
    lines = sass.splitlines()
    loops = []
    for i, line in enumerate(lines):
        label = re.match(r"^(\.L_x_\d+):", line)
        if not label:
            continue
        back = [j for j in range(i + 1, len(lines)) if f"`({label[1]})" in lines[j]]
        if back:
            ops = [re.search(r"\*/\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", ln) for ln in lines[i + 1 : back[0] + 1]]
            loops.append(dict(collections.Counter(m[1] for m in ops if m)))
    fmas = ("FFMA", "HFMA2", "HGMMA")
    return max(loops, key=lambda ops: (sum(ops.get(op, 0) for op in fmas), sum(ops.values())), default={})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    report = {name: compile_sm90(*spec) for name, spec in KERNELS.items()}
    if args.json:
        print(json.dumps(report))
        return
    for name, r in report.items():
        top = ", ".join(f"{op} {n}" for op, n in sorted(r["loop"].items(), key=lambda kv: -kv[1])[:12])
        print(f"{name}: {r['regs']} regs, {r['spills']} B spilled, {r['smem']} B smem; loop: {top}")


if __name__ == "__main__":
    main()
