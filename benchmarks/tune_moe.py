"""Tile configurations for the fused MoE, by grid search on this GPU: writes the JSON that
atomc/kernels/triton/moe_config.py reads (configs/E=..,H=..,I=..,topk=..,dtype=..,device=...json).

    python benchmarks/tune_moe.py --shapes qwen3_moe [--tokens 1,8,64,512] [--quick] [--out-dir DIR]
    python benchmarks/tune_moe.py --shapes gpt_oss --weights mxfp4   # quantised experts' own file
    python benchmarks/tune_moe.py --shapes deepseek_v3 --weights fp8_block --tokens 2,8 --merge  # add buckets
    python benchmarks/tune_moe.py --tiny --shapes toy --out-dir /tmp/tiles  # CPU smoke run (interpreter)

`--weights mxfp4 | fp8_channel | fp8_block` tunes the quantised kernels (moe_quant.py) on the
experts quantised as benchmarks/moe_kernel.py does it, into the file named with the format
(`...,weights=mxfp4,device=...json`); their one-token route always fuses the combine, so the
unfused down candidates are left out, and each GEMV tile is tried on both loops (`packed_f16`
false and true), so the file records which one wins.

Per M bucket it tries every route that can take M tokens (the one-token GEMV, the few-pair route
when M * top_k fits it, the sorted route) and keeps the fastest, so the file also records where
each route takes over. The gate/up tile is searched
with the down tile at its default (the one-token down tile also chooses whether the combine is fused
into it), then the down tile with the best gate/up (the sorted route's two
GEMMs share block_m, searched outside). Each candidate is timed as in benchmarks/moe_kernel.py (a
CUDA graph of calls with different routings, weights from HBM); candidates that fail to compile
(too much shared memory) are skipped. A bucket keeps what the device runs today (its own file, its
family's, or the default) unless a candidate beats it. A few minutes per shape on an H200.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import moe_kernel
import torch
from moe_kernel import SHAPES, graph_time_us, quantize_experts

from atomc.kernels.triton import moe_config
from atomc.kernels.triton.moe import fused_experts
from atomc.kernels.triton.tuned_files import tile_device
from atomc.ops.moe import select_experts
from atomc.ops.moe_quant import WEIGHT_FORMATS

VERBOSE = False  # --verbose: every candidate's time
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
SMALL_TILES = [dict(block_m=0, block_n=n, block_k=k, num_warps=w, num_stages=s)
               for n, k, w, s in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3,))]  # fmt: skip
GEMV_TILES = [dict(block_m=0, block_n=n, block_k=k, num_warps=w, num_stages=4)
              for n, k, w in itertools.product((1, 2, 4, 8), (512, 1024, 2048), (4, 8))]  # fmt: skip
# the one-token down GEMV: with the combine fused in (fewer programs: wider tiles too), or not
GEMV_DOWN_TILES = ([dict(t, fuse_combine=True) for t in GEMV_TILES]
                   + [dict(block_m=0, block_n=16, block_k=k, num_warps=w, num_stages=4, fuse_combine=True)
                      for k, w in itertools.product((256, 512, 1024), (4, 8))]
                   + [dict(t, fuse_combine=False) for t in GEMV_TILES])  # fmt: skip
SORTED_TILES = [dict(block_n=n, block_k=k, num_warps=w, num_stages=s)
                for n, k, w, s in ((64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3),
                                   (128, 128, 8, 3), (64, 64, 4, 4), (128, 64, 8, 4), (256, 64, 8, 3))]  # fmt: skip
SORTED_BLOCK_M = (16, 32, 64, 128)
TOY_SHAPE = (4, 32, 32, 2, "silu", False)  # --tiny --shapes toy: the smallest, for the test suite


def timer(weights13, weights2, b13, b2, act, calls, weights_fmt: str = "bf16"):
    """weights13 / weights2: the bf16 experts, or for a quantised format (packed, scale) pairs."""

    def run(cfg: dict):
        if weights_fmt == "bf16":
            return lambda x, w, i: fused_experts(x, w, i, weights13, weights2, b13, b2, None, act, config=cfg)
        from atomc.kernels.triton.moe_quant import fused_experts_quant

        (q13, s13), (q2, s2) = weights13, weights2
        return lambda x, w, i: fused_experts_quant(x, w, i, q13, s13, q2, s2, b13, b2, None, act, 1.702, 7.0,
                                                   weights_fmt, config=cfg)  # fmt: skip

    def time_config(cfg: dict) -> float:
        try:
            fn = run(cfg)
            us = graph_time_us(fn, calls)
            if VERBOSE:
                print(f"    {us:8.1f} us {cfg}")
            return us
        except Exception as exc:  # out of shared memory, too many registers: not a candidate
            print(f"    skip {cfg}: {type(exc).__name__}")
            return float("inf")

    return time_config


def search(time_config, path: str, gate_up_tiles: list[dict], down_tiles: list[dict], default: dict):
    """(µs, configuration) of the best gate/up tile, then the best down tile with it."""
    base = {"path": path, "gate_up": dict(default), "down": dict(default)}
    best_us, best_gu = min((time_config({**base, "gate_up": t}), i) for i, t in enumerate(gate_up_tiles))
    base["gate_up"] = gate_up_tiles[best_gu]
    best_us, best_dn = min((time_config({**base, "down": t}), i) for i, t in enumerate(down_tiles))
    return best_us, {**base, "down": down_tiles[best_dn]}


def choose(current: tuple[float, dict], default: tuple[float, dict], found: list[tuple[float, dict]]) -> tuple:
    """The (µs, configuration) a bucket keeps: the fastest, the current one on a tie, then the default."""
    return min([current, default, *found], key=lambda f: f[0])


def tune_shape(
    name: str, tokens: list[int], quick: bool, weights_fmt: str = "bf16", save=None, first_only: bool = False
) -> dict:
    """`save(result)` is called after every bucket, so a run cut short keeps the buckets it finished.
    `quick` tries a third of each grid (half the sorted one), `first_only` (--tiny) one tile of each."""
    DEV, BF16 = moe_kernel.DEV, moe_kernel.BF16  # noqa: N806  (--tiny sets them in main)

    def grid(tiles: list, quick_step: int) -> list:
        return tiles[:1] if first_only else tiles[::quick_step] if quick else tiles

    e, h, inter, k, act, bias = SHAPES[name]
    g = torch.Generator(DEV).manual_seed(0)
    w13 = (torch.randn(e, 2 * inter, h, generator=g, device=DEV) / h**0.5).to(BF16)
    w2 = (torch.randn(e, h, inter, generator=g, device=DEV) / inter**0.5).to(BF16)
    b13 = (0.5 * torch.randn(e, 2 * inter, generator=g, device=DEV)).to(BF16) if bias else None
    b2 = (0.5 * torch.randn(e, h, generator=g, device=DEV)).to(BF16) if bias else None
    fmt = "" if weights_fmt == "bf16" else weights_fmt
    if fmt:
        w13, w2 = quantize_experts(w13, fmt), quantize_experts(w2, fmt)
    buckets = {}
    dev = tile_device(torch.device(DEV))
    meta = {"shape": name, "device": dev.name, "family": dev.family, "torch": torch.__version__,
            "weights": weights_fmt}  # fmt: skip
    # what the device runs today (its own file or its family's, else the default), read before this
    # run writes any bucket: a tuned entry must beat it (ties keep it), so a quick run never ships a slower file
    current = {t: moe_config.pick_config.__wrapped__(t, e, h, inter, k, BF16, dev.name, moe_config.CONFIG_DIR,
                                                     fmt, dev.family) for t in tokens}  # fmt: skip
    for t in tokens:
        t0 = time.time()
        calls = []
        for _ in range(1 if first_only else 4 if t <= 64 else 2):
            weights, ids = select_experts(torch.randn(t, e, generator=g, device=DEV), k)
            calls.append((torch.randn(t, h, generator=g, device=DEV).to(BF16), weights, ids))
        time_config = timer(w13, w2, b13, b2, act, calls, weights_fmt)
        default = moe_config.with_packed_default(moe_config.default_config(t, k, e, inter, fmt), fmt)
        default_us = time_config(default)
        found = []
        if t == 1:
            tiles, down = grid(GEMV_TILES, 3), grid(GEMV_DOWN_TILES, 3)
            if fmt:  # the quantised one-token route always fuses the combine
                down = [tile for tile in down if tile["fuse_combine"]]
            if fmt in moe_config.PACKED_GEMV:  # each tile on both loops (the knob decides, not the default)
                tiles = [dict(tile, packed_f16=p) for tile in tiles for p in (False, True)]
                down = [dict(tile, packed_f16=p) for tile in down for p in (False, True)]
            found.append(search(time_config, "gemv", tiles, down, default["gate_up"]))
        if t * k <= moe_config.SMALL_PATH_MAX_PAIRS:
            tiles = grid(SMALL_TILES, 3)
            found.append(search(time_config, "small", tiles, tiles, moe_config.default_config(2, 1, e)["gate_up"]))
        for bm in SORTED_BLOCK_M[1::2] if quick else SORTED_BLOCK_M:
            if bm > 2 * max(16, t * k):  # rows mostly padding
                continue
            tiles = [dict(block_m=bm, **tile) for tile in grid(SORTED_TILES, 2)]
            found.append(search(time_config, "sorted", tiles, tiles, tiles[0]))
        current_us = default_us if current[t] == default else time_config(current[t])
        best_us, best = choose((current_us, current[t]), (default_us, default), found)
        buckets[str(t)] = best
        print(f"{name} M={t}: {best_us:.1f} us ({best['path']}), default {default_us:.1f} us, "
              f"current {current_us:.1f} us, {time.time() - t0:.0f} s")  # fmt: skip
        if save is not None:
            save({"buckets": buckets, "meta": meta})
    return {"buckets": buckets, "meta": meta}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default=",".join(map(str, BUCKETS)))
    ap.add_argument("--quick", action="store_true", help="a third of the grid")
    ap.add_argument("--out-dir", type=Path, default=moe_config.CONFIG_DIR)
    ap.add_argument("--weights", choices=("bf16", *WEIGHT_FORMATS), default="bf16", help="expert weight format")
    ap.add_argument("--verbose", action="store_true", help="print every candidate's time")
    ap.add_argument("--merge", action="store_true",
                    help="keep the buckets an existing file in --out-dir has and this run does not tune")  # fmt: skip
    ap.add_argument("--tiny", action="store_true",
                    help="toy shapes on the CPU (TRITON_INTERPRET=1, fp32), one tile a grid: a smoke run")  # fmt: skip
    args = ap.parse_args()
    global VERBOSE
    VERBOSE = args.verbose
    if args.tiny:
        if args.out_dir == moe_config.CONFIG_DIR:
            raise SystemExit("--tiny tunes toy shapes: give --out-dir (not the shipped configs)")
        moe_kernel.DEV, moe_kernel.BF16 = "cpu", torch.float32
        SHAPES.update(moe_kernel.TINY_SHAPES, toy=TOY_SHAPE)
        if args.tokens == ",".join(map(str, BUCKETS)):
            args.tokens = "1,3"
    tokens = [int(t) for t in args.tokens.split(",")]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    device_name = tile_device(torch.device(moe_kernel.DEV)).name
    for name in args.shapes.split(","):
        e, h, inter, k, _, _ = SHAPES[name]
        fmt = "" if args.weights == "bf16" else args.weights
        path = args.out_dir / moe_config.config_name(e, h, inter, k, moe_kernel.BF16, device_name, fmt)
        kept = json.loads(path.read_text())["buckets"] if args.merge and path.is_file() else {}

        def save(result: dict, path: Path = path, kept: dict = kept) -> None:
            merged = {**kept, **result["buckets"]}
            buckets = {m: merged[m] for m in sorted(merged, key=int)}
            path.write_text(json.dumps({**result, "buckets": buckets}, indent=1) + "\n")

        tune_shape(name, tokens, args.quick, args.weights, save=save, first_only=args.tiny)
        print(f"wrote {path}")
        if moe_kernel.DEV == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
