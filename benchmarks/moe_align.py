"""The MoE alignment alone (atomc/kernels/triton/moe_align.py): the torch ops against the one-launch
kernel, at the expert counts, top-k and row blocks of the models atomc serves, from a decode batch
that takes the sorted route to a prefill chunk.

    python benchmarks/moe_align.py --out results/moe_align.json
    python benchmarks/moe_align.py --tiny   # CPU smoke run through the Triton interpreter

Each way (the torch ops, the kernel as the tree has it, the kernel with `GATHER_PICK` off: the
one-hot pick) is timed
as the replay of a CUDA graph of `--layers` calls (each its own routing, as a model's MoE layers),
after checking the kernel's outputs equal the torch ops' entry for entry; past the kernel's
ONE_KERNEL_MAX_PAIRS (`--max-pairs` raises it for the run) only the torch ops run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

TINY = "--tiny" in sys.argv
if TINY:
    os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import

import torch  # noqa: E402
from graph_timing import graph_time_us, save_results  # noqa: E402

align = importlib.import_module("atomc.kernels.triton.moe_align")
# name: (experts, top_k, block_m of the sorted route's tuned tiles at 64+ tokens)
SHAPES = {
    "qwen3-30b-a3b": (128, 8, 16),
    "deepseek-v2-lite": (66, 8, 16),  # 64 routed + 2 shared experts inside the op
    "deepseek-v3": (257, 9, 64),  # 256 routed + 1 shared
    "mixtral-8x7b": (8, 2, 64),
}
TOKENS = (16, 64, 256, 1024, 2048)
TINY_SHAPES = {"tiny": (6, 2, 16)}
TINY_TOKENS = (3, 40)


def routings(tokens, experts, k, layers, dev, g) -> list[tuple]:
    """Each layer's local ids [tokens * k]: k distinct experts a token, as top-k gives them."""
    out = []
    for _ in range(layers):
        scores = torch.rand(tokens, experts, generator=g, device=dev)
        out.append((scores.topk(k, dim=1).indices.to(torch.int32).flatten().contiguous(),))
    return out


def align_by_expert_one_hot(local, experts: int, block_m: int):
    """The kernel with GATHER_PICK off (the [chunk, bins] one-hot pick), for this call."""
    before = align.GATHER_PICK
    align.GATHER_PICK = False
    try:
        return align.align_by_expert_kernel(local, experts, block_m)
    finally:
        align.GATHER_PICK = before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--layers", type=int, default=48, help="calls in one graph, each its own routing")
    ap.add_argument("--max-pairs", type=int, default=None, help="the kernel's pair limit for this run")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    if args.max_pairs:
        align.ONE_KERNEL_MAX_PAIRS = args.max_pairs
    dev = "cpu" if TINY else "cuda"
    layers = 2 if TINY else args.layers
    g = torch.Generator(dev).manual_seed(0)
    results = []
    for name, (experts, k, block_m) in (TINY_SHAPES if TINY else SHAPES).items():
        for tokens in TINY_TOKENS if TINY else TOKENS:
            calls = routings(tokens, experts, k, layers, dev, g)
            ways = ("torch", "kernel", "one_hot") if tokens * k <= align.ONE_KERNEL_MAX_PAIRS else ("torch",)
            want = align.align_by_expert_torch(calls[0][0], experts, block_m)
            for way in ways[1:]:
                got = WAYS[way](calls[0][0], experts, block_m)
                if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
                    raise SystemExit(f"{name} at {tokens} tokens: the {way} alignment differs from the torch ops'")
            row = {"model": name, "tokens": tokens, "pairs": tokens * k, "experts": experts, "block_m": block_m}
            if not TINY:
                for way in ways:
                    fn = WAYS[way]
                    row[f"{way}_us"] = graph_time_us(lambda ids, f=fn, e=experts, b=block_m: f(ids, e, b), calls)
            results.append(row)
            print(json.dumps(row), flush=True)
    save_results(args.out, results, TINY)


# the torch ops, the kernel as the tree has it, and the kernel with GATHER_PICK off
WAYS = {
    "torch": align.align_by_expert_torch,
    "kernel": align.align_by_expert_kernel,
    "one_hot": align_by_expert_one_hot,
}

if __name__ == "__main__":
    main()
