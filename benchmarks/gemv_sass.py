"""The one-row GEMVs compiled for sm_90 on any machine (Triton's own ptxas / nvdisasm, as
moe_sass.py): the instructions each thread's main loop runs per weight byte, bf16 against FP8.

    python benchmarks/gemv_sass.py [--json]

Why: on an H100 the FP8 GEMVs of a batch-1 step read their weights at 2.62 TB/s against the bf16
GEMVs' 3.06 (docs/performance.md section 15). The CUDA-core loop that both share (`gemv.row_dot`)
widens each e4m3 value to fp32 before its FMA: per weight byte the FP8 loop runs about 1.8x the
bf16 loop's instructions (4.0 against 2.3 at 2 rows x 2,048). The packed-f16 loop (`reduce_f16`:
e4m3x2 -> f16x2 and one f16x2 FMA a weight pair) runs 2.25, bf16's count. N and K are marked divisible by 16, as
the JIT marks Llama's 4,096-wide shapes, so the loads are 16-byte vectors, as they run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_sass import compile_sm90  # noqa: E402  (sets up the compiled, not interpreted, kernels)

from atomc.kernels.triton.fp8_gemv import _fp8_gemv_kernel  # noqa: E402
from atomc.kernels.triton.gemv import _gemv_reduce_kernel  # noqa: E402

SHAPE_INTS = dict(N="i32", K="i32", stride_wn="i32")
# name: (kernel, signature, constexprs, weight bytes a loop step reads across the program)
KERNELS = {
    "bf16 reduce": (_gemv_reduce_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", b_ptr="*bf16", y_ptr="*bf16", **SHAPE_INTS),
                    dict(HAS_BIAS=False, BLOCK_N=2, BLOCK_K=2048, PDL=True), 2 * 2048 * 2),
    "fp8 reduce": (_fp8_gemv_kernel, dict(x_ptr="*fp8e4nv", xs_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32",
                   b_ptr="*bf16", y_ptr="*bf16", **SHAPE_INTS, stride_wsn="i32"),
                   dict(WS_ROWS=True, HAS_BIAS=False, BLOCK_N=2, BLOCK_K=2048, PDL=True, F16_SUMS=False,
                        X_SHIFT=1.0), 2 * 2048),
    "fp8 reduce_f16": (_fp8_gemv_kernel, dict(x_ptr="*fp8e4nv", xs_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32",
                       b_ptr="*bf16", y_ptr="*bf16", **SHAPE_INTS, stride_wsn="i32"),
                       dict(WS_ROWS=True, HAS_BIAS=False, BLOCK_N=2, BLOCK_K=2048, PDL=True, F16_SUMS=True,
                            X_SHIFT=0.125), 2 * 2048),
}  # fmt: skip
THREADS = 4 * 32  # 4 warps


def report() -> dict:
    out = {}
    for name, (fn, sig, consts, step_bytes) in KERNELS.items():
        r = compile_sm90(fn, sig, consts, 4, 4, aligned_ints=("stride", "N", "K"))
        per_thread = sum(r["loop"].values())
        out[name] = dict(r, loop_instructions=per_thread, per_weight_byte=per_thread * THREADS / step_bytes)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    r = report()
    if args.json:
        print(json.dumps(r))
        return
    for name, k in r.items():
        top = ", ".join(f"{op} {n}" for op, n in sorted(k["loop"].items(), key=lambda kv: -kv[1])[:8])
        print(f"{name}: {k['regs']} regs, {k['loop_instructions']} loop instructions a thread, "
              f"{k['per_weight_byte']:.2f} a weight byte; loop: {top}")  # fmt: skip


if __name__ == "__main__":
    main()
