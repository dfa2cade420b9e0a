"""The Triton MLA decode kernel alone (atomc.kernels.triton.mla_attention) at DeepSeek-V3's widths
(128 heads, kv_lora 512, rope 64, pages of 16), bf16, bs 1/8/32/64 x context 1k/4k/16k, next to
atomc::mla_attention's torch reference.

    python benchmarks/mla_decode.py --out results/mla_decode.json [--bs 1,8] [--ctx 4096] [--no-reference]
    python benchmarks/mla_decode.py --sweep --bs 8,64 --ctx 4096,16384   # old and new tilings side by side
    python benchmarks/mla_decode.py --heads 16 --bs 8,64 --ctx 4096,16384  # V3's shard at TP 8 (memory-bound)
    python benchmarks/mla_decode.py --tiny     # CPU smoke run through the Triton interpreter

GB/s counts the latent bytes read once (bs x ctx x 576 x 2), the floor any MLA decode must read
(queries and outputs are small beside it); the issue's target is >= 70% of HBM bandwidth at
bs >= 8, ctx >= 4k. The bandwidth is measured here (a 1 GiB device-to-device copy, bytes read +
written over the time). At 128 heads the decode is compute-bound, though (1.89 x heads = 242 FLOP
a latent byte, above an H200's ridge of 230: benchmarks/ceilings.py, `mla_decode_roofline`), so
each row gives both: % of the copy bandwidth, and % of the roofline max(bytes / bandwidth, FLOPs /
peak) with the datasheet's dense bf16 peak (and, beside it, with a cuBLAS GEMM's measured rate,
what throttled clocks leave). The kernel is timed as CUDA-graph replays of
calls over R different caches (R x the latent bytes >= 512 MiB), as a model's layers each read
their own cache, so the latent comes from HBM and not from L2 (50 MiB on an H200 holds a whole
bs 8 x 4k latent). The reference gathers the pages and runs SDPA; it gets do_bench once per row.
Each row's kernel output is checked against the reference first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

TINY = "--tiny" in sys.argv
if TINY:
    os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import

import torch  # noqa: E402
from ceilings import dense_bf16_peak, mla_decode_roofline  # noqa: E402
from graph_timing import graph_time_us  # noqa: E402

from atomc.forward_context import AttentionMetadata  # noqa: E402
from atomc.kernels.triton.mla_attention import mla_attention  # noqa: E402
from atomc.kernels.triton.paged_attention import _pick_segments  # noqa: E402
from atomc.ops.attention import paged_attention_reference  # noqa: E402

HEADS, LORA, ROPE, PAGE = 128, 512, 64, 16
BS, CTX = (1, 8, 32, 64), (1024, 4096, 16384)


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def decode_batch(bs: int, ctx: int, heads: int, lora: int, rope: int, dtype, dev, caches: int = 1, seed: int = 0):
    """Queries and metadata of bs decode rows at context ctx, and `caches` latent pools whose pages
    the same (shuffled) block tables index."""
    g = torch.Generator(dev).manual_seed(seed)
    pages = -(-ctx // PAGE)
    blocks = bs * pages
    tables = torch.randperm(blocks, generator=g, device=dev).view(bs, pages).int()
    pools = [torch.randn(blocks, PAGE, 1, lora + rope, generator=g, device=dev).to(dtype) for _ in range(caches)]
    q_absorbed = torch.randn(bs, heads, lora, generator=g, device=dev).to(dtype)
    q_pe = torch.randn(bs, heads, rope, generator=g, device=dev).to(dtype)
    starts = list(range(bs + 1))
    meta = AttentionMetadata(
        slot_mapping=torch.full((bs,), -1, dtype=torch.long, device=dev),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.full((bs,), ctx, dtype=torch.int32, device=dev),
        block_tables=tables,
        query_start_loc_host=starts,
        seq_lens_host=[ctx] * bs,
        max_query_len=1,
        max_seq_len=ctx,
        num_seqs=bs,
    )
    return q_absorbed, q_pe, pools, meta


def kernel(q_absorbed, q_pe, cache, out, meta, scale, **kw):
    mla_attention(
        q_absorbed, q_pe, cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
        meta.max_query_len, meta.max_seq_len, meta.num_seqs, **kw,
    )  # fmt: skip
    return out


def reference(q_absorbed, q_pe, cache, meta, scale, rows_at_once: int = 4):
    """The torch reference, `rows_at_once` decode rows a call: all 64 rows of bs 64 x 128 heads at
    once wanted 72 GiB for SDPA's mask."""
    out = torch.empty_like(q_absorbed)
    lora = q_absorbed.shape[-1]
    q = torch.cat([q_absorbed, q_pe], -1)
    for i in range(0, meta.num_seqs, rows_at_once):
        n = min(rows_at_once, meta.num_seqs - i)
        lens = meta.seq_lens_host[i : i + n]
        part = AttentionMetadata(
            slot_mapping=meta.slot_mapping[i : i + n],
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=q.device),
            seq_lens=meta.seq_lens[i : i + n],
            block_tables=meta.block_tables[i : i + n],
            query_start_loc_host=list(range(n + 1)),
            seq_lens_host=lens,
            max_query_len=1,
            max_seq_len=max(lens),
            num_seqs=n,
        )
        paged_attention_reference(q[i : i + n], cache, cache[..., :lora], out[i : i + n], part, scale)
    return out


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + written)."""
    from triton.testing import do_bench

    x = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=5, rep=50, return_mode="median")
    return 2 * x.numel() * 2 / (ms * 1e-3)


def matmul_rate() -> float:
    """FLOP/s of a bf16 cuBLAS GEMM, 8192 x 8192 x 8192: the tensor-core rate this GPU sustains."""
    from triton.testing import do_bench

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = do_bench(lambda: a @ b, warmup=5, rep=50, return_mode="median")
    return 2 * 8192**3 / (ms * 1e-3)


def roofline_fields(bs: int, ctx: int, us: float, bw: float, peak: float, gemm: float, heads: int = HEADS) -> dict:
    """A row's rates against the copy bandwidth and the two rooflines (datasheet peak, GEMM rate)."""
    r = mla_decode_roofline(bs, ctx, heads, LORA, ROPE, bw, peak)
    at_gemm = mla_decode_roofline(bs, ctx, heads, LORA, ROPE, bw, gemm)
    return dict(
        gbps=round(r["latent_bytes"] / us / 1e3, 1),
        tflops=round(r["flops"] / us / 1e6, 1),
        pct_bw=round(100 * r["memory_s"] / (us * 1e-6), 1),
        pct_roofline=round(100 * r["bound_s"] / (us * 1e-6), 1),
        pct_gemm_roofline=round(100 * at_gemm["bound_s"] / (us * 1e-6), 1),
        bound=r["bound"],
    )


# --sweep: the tiling before the compute-bound rework (32 heads, 64 keys, 4 warps, with the MHA
# decode's segment rule: "old"), the new 64-head / 8-warp tiles over keys a step x stages x c_kv
# pieces (64 keys x 3 stages would need 288 KiB of shared memory: left out), and the new default
# with forced segment counts (bs 8's auto is 8, bs 64's 1)
OLD = dict(block_h=32, tile_n=64, num_warps=4, num_stages=2, dv_split=1, num_segments="old")
NEW = dict(block_h=64, tile_n=64, num_warps=8, num_stages=2, dv_split=2)  # the kernel's default
SWEEP = (
    [OLD]
    + [dict(NEW, tile_n=n, num_stages=st, dv_split=dv) for n, st in ((32, 2), (32, 3), (64, 2)) for dv in (1, 2)]
    + [dict(NEW, num_segments=k) for k in (2, 4, 16)]
)


def resolve(kw: dict, bs: int, ctx: int, heads: int = HEADS) -> dict:
    """`num_segments="old"`: the count the MHA decode's rule gives (what the kernel used before)."""
    if kw.get("num_segments") != "old":
        return kw
    head_blocks = -(-heads // kw["block_h"])
    return dict(kw, num_segments=_pick_segments(torch.device("cuda", 0), bs, head_blocks, ctx, kw["tile_n"]))


def bench_rows(
    bs: int, ctx: int, rates: tuple[float, float, float], configs: list[dict], with_reference: bool, heads: int = HEADS
) -> list[dict]:
    """One row per kernel config in `configs` (a failing one, e.g. out of shared memory, records
    its error), over the same inputs; the reference's time on every row."""
    from triton.testing import do_bench

    scale = 192**-0.5
    latent_bytes = bs * ctx * (LORA + ROPE) * 2
    caches = max(2, min(32, -(-(512 << 20) // latent_bytes)))
    q_absorbed, q_pe, pools, meta = decode_batch(bs, ctx, heads, LORA, ROPE, torch.bfloat16, "cuda", caches)
    out = torch.empty_like(q_absorbed)
    ref = reference(q_absorbed, q_pe, pools[0], meta, scale)
    ref_us = None
    if with_reference:
        ref_us = round(do_bench(lambda: reference(q_absorbed, q_pe, pools[0], meta, scale), warmup=2, rep=20) * 1e3, 1)
    rows = []
    for config in configs:
        kw = resolve(config, bs, ctx, heads)
        row = dict(bs=bs, ctx=ctx, heads=heads, config=config, launched=kw, reference_us=ref_us)
        try:
            row["rel_err"] = rel_err(kernel(q_absorbed, q_pe, pools[0], out, meta, scale, **kw), ref)
            us = graph_time_us(
                lambda c, kw=kw: kernel(q_absorbed, q_pe, c, out, meta, scale, **kw), [(c,) for c in pools], 50
            )
        except Exception as exc:  # a config the GPU cannot hold
            row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            print(f"bs {bs:3d} ctx {ctx:6d} {kw}: failed: {row['error']}")
            rows.append(row)
            continue
        row.update(us=round(us, 2), **roofline_fields(bs, ctx, us, *rates, heads))
        rows.append(row)
        print(f"bs {bs:3d} ctx {ctx:6d}: {row_text(row)} reference {ref_us or float('nan'):9.1f} us"
              f" err {row['rel_err']:.1e} {kw or ''}")  # fmt: skip
    return rows


def row_text(row: dict) -> str:
    return (
        f"{row['us']:8.1f} us {row['gbps']:7.1f} GB/s {row['tflops']:6.1f} TFLOP/s: {row['pct_bw']:5.1f}% of copy bw,"
        f" {row['pct_roofline']:5.1f}% of the {row['bound']}-bound roofline ({row['pct_gemm_roofline']:5.1f}% at"
        " the GEMM rate)"
    )


def run_gpu(args) -> None:
    bw, gemm = copy_bandwidth(), matmul_rate()
    name = torch.cuda.get_device_name()
    peak = dense_bf16_peak(name) or gemm
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s, bf16 GEMM {gemm / 1e12:.0f} TFLOP/s, peak {peak / 1e12:.0f}"
          f" TFLOP/s ({name}); ridge {peak / bw:.0f} FLOP/B against 1.89 x {args.heads}"
          f" = {1.889 * args.heads:.0f}")  # fmt: skip
    knobs = dict(
        num_segments=args.segments, tile_n=args.tile_n, block_h=args.block_h, num_warps=args.num_warps,
        num_stages=args.num_stages, dv_split=args.dv_split,
    )  # fmt: skip
    kw = {k: v for k, v in knobs.items() if v}
    configs = [dict(c, **kw) for c in SWEEP] if args.sweep else [kw]
    rows = []
    for ctx in args.ctx:
        for bs in args.bs:
            found = bench_rows(bs, ctx, (bw, peak, gemm), configs, not args.no_reference, args.heads)
            rows += found
            if args.sweep and any("us" in r for r in found):
                best = min((r for r in found if "us" in r), key=lambda r: r["us"])
                print(f"  best at bs {bs} ctx {ctx}: {best['config']} {row_text(best)}")
            torch.cuda.empty_cache()  # the row's caches are gone with its frame
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version())
    meta.update(
        copy_bandwidth_gbps=round(bw / 1e9, 1), gemm_tflops=round(gemm / 1e12, 1), peak_tflops=round(peak / 1e12, 1)
    )
    meta.update(knobs=kw, sweep=args.sweep)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


def run_tiny() -> None:
    """The same rows at tiny widths on the CPU, through the interpreter: the script's plumbing and
    the kernel's agreement with the reference, not a speed (interpreted Triton is slow)."""
    heads, lora, rope = 8, 32, 16
    for bs, ctx in ((1, 100), (3, 70)):  # a context past a page edge, uneven pages
        q_absorbed, q_pe, (cache,), meta = decode_batch(bs, ctx, heads, lora, rope, torch.float32, "cpu")
        out = torch.empty_like(q_absorbed)
        t0 = time.perf_counter()
        kernel(q_absorbed, q_pe, cache, out, meta, 0.2, tile_n=16)
        ms = (time.perf_counter() - t0) * 1e3
        err = rel_err(out, reference(q_absorbed, q_pe, cache, meta, 0.2, rows_at_once=2))  # 3 rows: 2 + 1
        latent = bs * ctx * (lora + rope) * 4
        print(f"tiny bs {bs} ctx {ctx}: {latent} latent bytes, {ms:.0f} ms interpreted, err {err:.1e}")
        assert err < 1e-5, f"kernel and reference disagree: {err}"
    # the GPU rows' arithmetic, at V3 widths with an H200's nominal rates and a made-up 100 us
    row = dict(us=100.0, **roofline_fields(64, 4096, 100.0, 4.3e12, 989.4e12, 800e12))
    print(f"roofline check bs 64 ctx 4096 at 100 us: {row_text(row)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("results/mla_decode.json"))
    ap.add_argument("--bs", type=lambda s: [int(x) for x in s.split(",")], default=list(BS))
    ap.add_argument("--ctx", type=lambda s: [int(x) for x in s.split(",")], default=list(CTX))
    ap.add_argument("--heads", type=int, default=HEADS,
                    help="query heads (128: V3 on one GPU; 16: its shard at TP 8, memory-bound)")  # fmt: skip
    ap.add_argument("--segments", type=int, default=None, help="force the split-KV segment count")
    ap.add_argument("--tile-n", type=int, default=None, help="keys a step (default: the kernel's)")
    ap.add_argument("--block-h", type=int, default=None, help="heads a tile (default: the kernel's)")
    ap.add_argument("--num-warps", type=int, default=None, help="warps a program (default: the kernel's)")
    ap.add_argument("--num-stages", type=int, default=None, help="pipeline stages (default: the kernel's)")
    ap.add_argument("--dv-split", type=int, default=None, help="c_kv pieces, 1 or 2 (default: the kernel's)")
    ap.add_argument("--sweep", action="store_true", help="time every config of SWEEP (old tiling, new tiles, segments)")
    ap.add_argument("--no-reference", action="store_true", help="skip timing the torch reference")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run through the Triton interpreter")
    args = ap.parse_args()
    if args.tiny:
        run_tiny()
    else:
        run_gpu(args)


if __name__ == "__main__":
    main()
