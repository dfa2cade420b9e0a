"""MLA's absorbed per-head products at one token (atomc::head_matmul, atomc/kernels/triton/head_matmul.py)
alone, per tile, against the bmm they replace: q_nope x W_UK (w [H, nope, kv_lora], columns
contiguous: the columns kernel) and the attention output x W_UV^T (w [H, v, kv_lora], rows
contiguous: the rows kernel), at DeepSeek-V2-Lite's and V3's widths.

    python benchmarks/head_matmul.py --out results/head_matmul.json
    python benchmarks/head_matmul.py --tiny   # CPU smoke run through the Triton interpreter

Each tile is timed as the replay of a CUDA graph of `--layers` calls on separate weights (a
model's back-to-back layers, weights from HBM) and checked against the bmm. A call moves 2 MB at
V2-Lite's widths (16 heads) and 16 MB at V3's (128), so at 16 heads this is latency.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import sys

TINY = "--tiny" in sys.argv
if TINY:
    os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import

import torch  # noqa: E402
from graph_timing import graph_time_us, save_results  # noqa: E402

from atomc.ops.head_matmul import head_matmul_reference  # noqa: E402

# the module (the package exports its function under the same name)
kernels = importlib.import_module("atomc.kernels.triton.head_matmul")
# name: (heads, nope, v, kv_lora)
SHAPES = {"deepseek-v2-lite": (16, 128, 128, 512), "deepseek-v3": (128, 128, 128, 512)}
TINY_SHAPES = {"tiny": (2, 32, 16, 64)}
# (block_n, block_k, num_warps); None: the kernel's default
ROWS_TILES = [None, *itertools.product((4, 8, 16), (256, 512), (2, 4))]
COLUMNS_TILES = [None, *itertools.product((16, 32, 64, 128), (64, 128), (2, 4))]
TINY_TILES = [None, (8, 32, 1)]
REL_OK = 1e-2  # bf16 outputs of fp32 sums in another order than the bmm's


def layer_weights(shape, transpose_w, layers, dtype, dev, g):
    """`layers` weights as the model slices them out of kv_b_proj's [H, nope + v, kv_lora] weight:
    W_UK the first nope rows of each head, W_UV the v rows after."""
    heads, nope, v, kv_lora = shape
    out = []
    for _ in range(layers):
        kv_b = (torch.randn(heads, nope + v, kv_lora, generator=g, device=dev) / kv_lora**0.5).to(dtype)
        out.append(kv_b[:, nope:] if transpose_w else kv_b[:, :nope])
    return out


def time_layout(name, shape, transpose_w, layers, dtype, dev) -> list[dict]:
    heads, nope, v, kv_lora = shape
    k = kv_lora if transpose_w else nope
    g = torch.Generator(dev).manual_seed(0)
    ws = layer_weights(shape, transpose_w, layers, dtype, dev, g)
    xs = [torch.randn(1, heads, k, generator=g, device=dev).to(dtype) for _ in range(layers)]
    ref = head_matmul_reference(xs[0], ws[0], transpose_w).float()
    kind = "rows (W_UV^T)" if transpose_w else "columns (W_UK)"
    rows = []

    def run(fn, label, cfg):
        out = fn(xs[0], ws[0]).float()
        err = ((out - ref).norm() / ref.norm()).item()
        us = None if TINY else graph_time_us(fn, list(zip(xs, ws, strict=True)))
        rows.append({"model": name, "product": kind, "config": cfg, "us": us, "rel_err": err})
        print(json.dumps(rows[-1]), flush=True)
        if err > REL_OK:
            raise SystemExit(f"{name} {kind} {label}: relative error {err:.2e} against the bmm")

    run(lambda x, w: head_matmul_reference(x, w, transpose_w), "bmm", "bmm")
    tiles = TINY_TILES if TINY else (ROWS_TILES if transpose_w else COLUMNS_TILES)
    for tile in tiles:
        knobs = {} if tile is None else dict(zip(("block_n", "block_k", "num_warps"), tile, strict=True))
        try:
            run(lambda x, w, kw=knobs: kernels.head_matmul(x, w, transpose_w, one_row=True, **kw), str(tile), knobs)
        except Exception as e:  # on the GPU, a tile that does not compile (shared memory) is skipped
            if TINY:
                raise
            print(f"# {name} {kind} {knobs}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--layers", type=int, default=27, help="calls in one graph, each its own weights")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    dev = "cpu" if TINY else "cuda"
    dtype = torch.float32 if TINY else torch.bfloat16  # the interpreter has no bf16
    layers = 2 if TINY else args.layers
    results = []
    for name, shape in (TINY_SHAPES if TINY else SHAPES).items():
        for transpose_w in (False, True):
            rows = time_layout(name, shape, transpose_w, layers, dtype, dev)
            results += rows
            timed = [r for r in rows if r["us"] is not None and r["config"] != "bmm"]
            if timed:
                best = min(timed, key=lambda r: r["us"])
                default = next(r for r in timed if r["config"] == {})
                print(f"== {name} {rows[0]['product']}: bmm {rows[0]['us']:.2f} us, default {default['us']:.2f} us, "
                      f"best {best['us']:.2f} us {best['config']}", flush=True)  # fmt: skip
    save_results(args.out, results, TINY)


if __name__ == "__main__":
    main()
