"""Compile the Triton paged-attention decode kernel for a Hopper GPU (sm_90) without one, over bf16
and over FP8 (e4m3) pages, and print what each costs: shared memory, registers and spilled bytes a
thread (from the cubin), the dots' kind and the async copies (mla_compile_check.resources).

    python benchmarks/attention_compile_check.py

Llama-3.1-8B's decode (32 query heads, 8 KV heads, head dim 128, pages of 16, split-KV): the
engine's default knobs (`paged_attention.default_tile_n` / `default_num_warps`), then FP8 pages at
other tiles and warp counts. What it showed: at 64-key tiles and 4 warps the FP8 kernel holds its
widened K and V operands whole, 186 registers a thread against bf16's 96; the H100 then ran FP8
decode fastest at 128-key tiles and 4 warps, 255 registers with a 24-byte spill, so registers alone
do not predict this kernel's time: time it (benchmarks/kernels_bench.py --kv-fp8 --sweep).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from mla_compile_check import compile_as_launched, resources  # noqa: E402

pa = importlib.import_module("atomc.kernels.triton.paged_attention")
HQ, HKV, D, PAGE, SEGMENTS = 32, 8, 128, 16, 8
POINTERS = {
    "q_ptr": "*bf16", "out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
    "counter_ptr": "*i32", "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32",
    "sinks_ptr": "*bf16", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
}  # fmt: skip


def compile_decode(fp8: bool, num_warps: int | None = None, tile_n: int | None = None, num_stages: int = 2):
    """The compiled _attn_kernel as a bf16 decode step launches it (the wrapper's block sizes)."""
    group = HQ // HKV
    block_m = max(16, triton.next_power_of_2(group))
    tile_n = tile_n or pa.default_tile_n(True, fp8)
    warps = num_warps or pa.default_num_warps(block_m, D, tile_n, fp8)
    consts = dict(
        HEAD_DIM=D, BLOCK_D=D, GROUP=group, NUM_Q_HEADS=HQ, BLOCK_M=block_m, BLOCK_Q=block_m // group,
        TILE_N=tile_n, PAGE=PAGE, NUM_SEGMENTS=SEGMENTS, SPLIT=True, MIN_SEG_TILES=pa.MIN_SEG_TILES, IEEE=False,
        WINDOW=0, SINKS=False, FP8=fp8, F16_DOTS=fp8, MERGE_LAST=False, PDL=True,
    )  # fmt: skip
    kv = "*fp8e4nv" if fp8 else "*bf16"
    pointers = {**POINTERS, "k_cache_ptr": kv, "v_cache_ptr": kv}
    return warps, tile_n, compile_as_launched(pa._attn_kernel, pointers, consts, warps, num_stages)


def main() -> None:
    for fp8, warps, tile_n in ((False, None, None), (True, None, None), (True, 8, 128), (True, 4, 64), (True, 8, 64)):
        used, tile, kernel = compile_decode(fp8, warps, tile_n)
        r = resources(kernel)
        default = " (default)" if warps is None else ""
        label = f"{'fp8' if fp8 else 'bf16'} pages, {tile}-key tiles, {used} warps{default}"
        print(f"{label}: {r['shared'] // 1024} KiB shared, {r['registers']} registers, {r['spill_bytes']} B spilled,"
              f" {r['mma_sync']} mma.sync / {r['wgmma']} wgmma dots, {r['async_copies']} async copies")  # fmt: skip


if __name__ == "__main__":
    main()
