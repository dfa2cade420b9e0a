"""Decode attention at small batches and short contexts, as a model's CUDA graph launches it: the
wrapper gets `max_seq_len` = the capture bound (max_model_len), not the context, so the split-KV
segment count is the one for the longest context, and a short context fills only the first
segments. Here the op is latency, not bytes (a 512-token context of Llama-3.1-8B is 2 MB a layer).

    python benchmarks/decode_attention_short.py --out results/decode_attention_short.json [--cap 4096]
    python benchmarks/decode_attention_short.py --merge --bs 1 --ctx 256,2048   # split-KV merges, A/B
    python benchmarks/decode_attention_short.py --tiny   # CPU smoke run through the Triton interpreter

Shapes: MHA at Llama-3.1-8B's GQA (32 query / 8 KV heads, head 128) and Qwen3-30B-A3B's (32 / 4);
MLA at DeepSeek-V2-Lite's widths (16 heads) and V3's (128), latent 512 + 64. For each case (bs x
context) every config of the grid (segments: 1 or the capture bound's; fewest tiles a segment; keys
a step; warps) is checked against the first config's output and timed as the replay of a CUDA
graph of one call per layer over `--layers` separate caches (each layer reads its own pages, as a
model's do), so the time a call includes its split-KV merge and the gaps between kernels in a graph.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
from pathlib import Path

TINY = "--tiny" in sys.argv
if TINY:
    os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import

import torch  # noqa: E402
from graph_timing import graph_time_us  # noqa: E402

from atomc.kernels.triton.mla_attention import mla_attention  # noqa: E402
from atomc.kernels.triton.paged_attention import MIN_SEG_TILES, paged_attention  # noqa: E402

PAGE = 16
MHA = {"llama-3.1-8b": (32, 8, 128), "qwen3-30b-a3b": (32, 4, 128)}  # q heads, KV heads, head dim
MLA = {"deepseek-v2-lite": (16, 512, 64), "deepseek-v3": (128, 512, 64)}  # heads, kv_lora, rope


def grid(tiny: bool, kind: str = "mha", merge: bool = False) -> list[dict]:
    """Split at the capture bound's count (None) x fewest tiles a segment x keys a step x warps,
    and no split (num_segments=1) per keys a step x warps. `merge`: the default tiling with each
    way of merging the split-KV partials (MHA: the reduce kernel or the attention kernel's last
    segment program; MLA: merge programs over whole rows or c_kv pieces of 32 / 64 / 128 columns)."""
    if merge:
        if kind == "mha":
            return [dict(merge_in_kernel=False), dict(merge_in_kernel=True)]
        return [dict(reduce_cols=c) for c in (0, 32, 64, 128)]
    if tiny:
        return [dict(num_segments=None, min_seg_tiles=m, tile_n=16) for m in (1, 4)] + [dict(num_segments=1, tile_n=16)]
    split = [dict(num_segments=None, min_seg_tiles=m, tile_n=n, num_warps=w)
             for m, n, w in itertools.product((1, 2, 4, 8, 16), (32, 64), (4, 8))]  # fmt: skip
    whole = [dict(num_segments=1, tile_n=n, num_warps=w) for n, w in itertools.product((32, 64), (4, 8))]
    return split + whole


def metadata(bs: int, ctx: int, dev: str, g: torch.Generator):
    pages = -(-ctx // PAGE)
    tables = torch.randperm(bs * pages, generator=g, device=dev).view(bs, pages).int()
    qsl = torch.arange(bs + 1, dtype=torch.int32, device=dev)
    seq_lens = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
    return tables, qsl, seq_lens, bs * pages


def mha_calls(shape, bs, ctx, cap, layers, dtype, dev):
    hq, hkv, d = shape
    g = torch.Generator(dev).manual_seed(0)
    tables, qsl, seq_lens, blocks = metadata(bs, ctx, dev, g)
    q = torch.randn(bs, hq, d, generator=g, device=dev).to(dtype)
    out = torch.empty_like(q)
    pools = [(torch.randn(blocks, PAGE, hkv, d, generator=g, device=dev).to(dtype),
              torch.randn(blocks, PAGE, hkv, d, generator=g, device=dev).to(dtype)) for _ in range(layers)]  # fmt: skip

    def call(kv, **kw):
        return paged_attention(q, *kv, out, qsl, seq_lens, tables, d**-0.5, 1, cap, bs, **kw)

    return pools, call, out


def mla_calls(shape, bs, ctx, cap, layers, dtype, dev):
    heads, lora, rope = shape
    g = torch.Generator(dev).manual_seed(0)
    tables, qsl, seq_lens, blocks = metadata(bs, ctx, dev, g)
    q_absorbed = torch.randn(bs, heads, lora, generator=g, device=dev).to(dtype)
    q_pe = torch.randn(bs, heads, rope, generator=g, device=dev).to(dtype)
    out = torch.empty_like(q_absorbed)
    pools = [torch.randn(blocks, PAGE, 1, lora + rope, generator=g, device=dev).to(dtype) for _ in range(layers)]

    def call(cache, **kw):
        return mla_attention(q_absorbed, q_pe, cache, out, qsl, seq_lens, tables, 192**-0.5, 1, cap, bs, **kw)

    return pools, call, out


def run_case(kind, name, shape, bs, ctx, cap, layers, configs, dtype, dev) -> list[dict]:
    make = mha_calls if kind == "mha" else mla_calls
    pools, call, out = make(shape, bs, ctx, cap, layers, dtype, dev)
    ref = None
    rows = []
    for kw in configs:
        row = dict(kind=kind, model=name, bs=bs, ctx=ctx, cap=cap, config=kw)
        try:
            got = call(pools[0], **kw).float().clone()
            ref = got if ref is None else ref
            row["rel_err_vs_first"] = ((got - ref).norm() / ref.norm()).item()
            assert row["rel_err_vs_first"] < (1e-2 if dtype != torch.float32 else 1e-5), row
            if dev == "cuda":
                row["us"] = round(graph_time_us(lambda p, kw=kw: call(p, **kw), [(p,) for p in pools]), 2)
        except Exception as exc:  # e.g. out of shared memory or registers
            row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        rows.append(row)
        print(json.dumps(row))
    timed = [r for r in rows if "us" in r]
    if timed:
        best = min(timed, key=lambda r: r["us"])
        default = next((r for r in timed if r["config"].get("num_segments") is None
                        and r["config"].get("min_seg_tiles") == MIN_SEG_TILES
                        and r["config"].get("tile_n") == 64), None)  # fmt: skip
        print(f"== {kind} {name} bs {bs} ctx {ctx} (cap {cap}): best {best['us']} us {best['config']}"
              f"; min_seg_tiles {MIN_SEG_TILES} / 64 keys: {default and default['us']} us")  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("results/decode_attention_short.json"))
    ap.add_argument("--cap", type=int, default=4096, help="max_seq_len the wrapper sees (the capture bound)")
    ap.add_argument("--bs", default="1,8")
    ap.add_argument("--ctx", default="128,512,2048")
    ap.add_argument("--layers", type=int, default=32, help="separate caches, one call each, in one graph")
    ap.add_argument("--models", default=",".join([*MHA, *MLA]))
    ap.add_argument("--merge", action="store_true", help="the default tiling, each way of merging split-KV partials")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    dev = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    bss, ctxs = [int(x) for x in args.bs.split(",")], [int(x) for x in args.ctx.split(",")]
    if args.tiny:
        bss, ctxs, layers = [1], [40], 1
        mha = {"tiny-mha": (4, 2, 16)}
        mla = {"tiny-mla": (4, 32, 16)}
    else:
        layers = args.layers
        mha, mla = MHA, MLA
    rows = []
    for name in args.models.split(",") if not args.tiny else [*mha, *mla]:
        kind = "mha" if name in mha else "mla"
        shape = (mha if kind == "mha" else mla)[name]
        configs = grid(args.tiny, kind, args.merge)
        for bs, ctx in itertools.product(bss, ctxs):
            rows += run_case(kind, name, shape, bs, ctx, max(args.cap, ctx), layers, configs, dtype, dev)
            if dev == "cuda":
                torch.cuda.empty_cache()
    meta = dict(torch=torch.__version__, python=platform.python_version(), cap=args.cap, layers=layers)
    if dev == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
