"""Compile the Triton MLA kernel for a Hopper GPU (sm_90) without one and print what each tiling
costs: shared memory, registers and spilled bytes a thread (from the cubin), and whether the dots
became warpgroup MMAs (wgmma) or the older mma.sync, and the loads async copies (pipelined).

    python benchmarks/mla_compile_check.py            # every config of mla_decode.py's --sweep
    python benchmarks/mla_compile_check.py --prefill  # the same tiles for a prefill step

A CPU-side check before a GPU call: a config that spills heavily or misses wgmma can be dropped
from the sweep. It asks Triton for the same specialisation a launch at V3's widths gets (16-byte
aligned pointers and strides, bf16, pages of 16), through Triton's own compiler entry points
(ASTSource, GPUTarget), which change between Triton releases; written against Triton 3.9.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

mla = importlib.import_module("atomc.kernels.triton.mla_attention")  # the package re-exports the function
HEADS, LORA, ROPE, PAGE = 128, 512, 64, 16
POINTERS = {
    "qc_ptr": "*bf16", "qr_ptr": "*bf16", "cache_ptr": "*bf16", "out_ptr": "*bf16",
    "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
    "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32", "kv_scale_ptr": "*fp32",
}  # fmt: skip


def compile_config(config: dict, decode: bool = True, segments: int = 1, arch: int = 90, fp8: bool = False):
    """The compiled _mla_kernel for `config` (mla_attention's knobs) at V3's widths; `fp8`: over an
    e4m3 latent cache (`--kv-cache-dtype fp8`), tiles widened to fp16 in the kernel (F16_DOTS)."""
    knobs = {k: config.get(k) for k in ("block_h", "tile_n", "num_warps", "num_stages", "dv_split")}
    t = mla.mla_tiles(HEADS, LORA, decode, 2, **knobs)
    consts = dict(
        KV_LORA=LORA, ROPE=ROPE, BLOCK_C=t["block_c"], BLOCK_R=ROPE, NUM_HEADS=HEADS, BLOCK_H=t["block_h"],
        HEAD_BLOCKS=-(-HEADS // t["block_h"]), BLOCK_M=t["block_m"], BLOCK_Q=t["block_q"], TILE_N=t["tile_n"],
        PAGE=PAGE, NUM_SEGMENTS=segments, SPLIT=segments > 1, MIN_SEG_TILES=mla.MIN_SEG_TILES,
        DV_SPLIT=t["dv_split"], DECODE=decode, PRECISION="tf32", FP8=fp8, F16_DOTS=fp8, PDL=True,
    )  # fmt: skip
    pointers = {**POINTERS, "cache_ptr": "*fp8e4nv"} if fp8 else POINTERS
    return compile_as_launched(mla._mla_kernel, pointers, consts, t["num_warps"], t["num_stages"], arch)


def compile_as_launched(fn, pointers: dict, consts: dict, num_warps: int, num_stages: int, arch: int = 90):
    """An attention kernel compiled as its wrapper launches it on a Hopper GPU (PDL on): `pointers`
    the pointer arguments' types, `qk_scale` fp32, other arguments i32; pointers and strides
    divisible by 16, as the JIT specialises them (num_seqs and stride_bt are not)."""
    names = fn.arg_names
    sig = {n: pointers.get(n) or ("constexpr" if n in consts else "fp32" if n == "qk_scale" else "i32") for n in names}
    aligned = [i for i, n in enumerate(names) if n in pointers or (n.startswith("stride") and n != "stride_bt")]
    src = ASTSource(
        fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()},
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
    )  # fmt: skip
    opts = dict(num_warps=num_warps, num_stages=num_stages, launch_pdl=True)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


WGMMA_WARPS = r"versionMajor = 3, versionMinor = \d+, warpsPerCTA = \[(\d+), (\d+)\]"


def resources(kernel) -> dict:
    """Shared bytes, and from the cubin (cuobjdump) registers and stack (spill) bytes a thread;
    counts of warpgroup MMAs, mma.sync dots and async copies in the kernel's TritonGPU IR, and the
    warps [along M, along N] of each warpgroup-MMA layout (M / 16 below the first number: warps
    along M past the tile's rows hold copies, so that dot runs once per warpgroup)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = dict(re.findall(r"\b(REG|STACK):(\d+)", usage))
    ir = kernel.asm["ttgir"]
    return dict(
        shared=kernel.metadata.shared, registers=int(found.get("REG", -1)), spill_bytes=int(found.get("STACK", -1)),
        wgmma=ir.count("ttng.warp_group_dot "), mma_sync=ir.count("tt.dot "),
        async_copies=ir.count("async_copy_global_to_local"),
        mma_warps=[[int(a), int(b)] for a, b in re.findall(WGMMA_WARPS, ir)],
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", action="store_true", help="prefill tiles (causal mask) instead of decode")
    ap.add_argument("--fp8", action="store_true", help="over an e4m3 latent cache (--kv-cache-dtype fp8)")
    args = ap.parse_args()
    from mla_decode import SWEEP

    seen = []
    for config in SWEEP:
        tiles = {k: v for k, v in config.items() if k != "num_segments"}
        if tiles in seen:
            continue
        seen.append(tiles)
        try:
            r = resources(compile_config(tiles, decode=not args.prefill, fp8=args.fp8))
        except Exception as exc:  # e.g. out of shared memory
            print(f"{tiles}: failed: {type(exc).__name__}: {str(exc)[:160]}")
            continue
        print(f"{tiles}: {r['shared'] // 1024} KiB shared, {r['registers']} registers, {r['spill_bytes']} B spilled,"
              f" {r['wgmma']} wgmma / {r['mma_sync']} mma.sync dots, {r['async_copies']} async copies,"
              f" wgmma warps {r['mma_warps']}")  # fmt: skip


if __name__ == "__main__":
    main()
