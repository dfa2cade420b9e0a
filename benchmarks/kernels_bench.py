"""Microbenchmarks of atomc's Triton kernels on one GPU (written for the H200), Llama-3.1-8B shapes.

    python benchmarks/kernels_bench.py --out results/kernels_h200.json [--quick] [--sweep]

Each case is checked against a torch reference before it is timed. Times are medians:
`us` from triton.testing.do_bench (L2 flushed before every call), `us_graph` from CUDA-graph
replay (launch overhead removed, L2 warm: small working sets fit in the 60 MB L2, so treat those
GB/s as optimistic). GB/s counts every input read once and every output written once; for
attention the context's K/V bytes plus q and out. % is of PEAK_GBPS,
the GPU's measured copy rate (`ceilings.copy_gbps`).
Writes the JSON to --out and a markdown table next to it (.md).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
from pathlib import Path

import ceilings
import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench, do_bench_cudagraph

from atomc.kernels.triton import fused_add_rms_norm, paged_attention, rope_and_write_kv, silu_and_mul
from atomc.kernels.triton.argmax import argmax_rows
from atomc.kernels.triton.gemv import gemv

PEAK_GBPS = ceilings.local_copy_gbps()
HQ, HKV, D, HIDDEN, INTER, PAGE = 32, 8, 128, 4096, 14336, 16
BF16 = torch.bfloat16
DEV = "cuda"
ROWS: list[dict] = []


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def timed(fn, graph: bool = True) -> tuple[float, float | None]:
    us = do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    us_graph = None
    if graph:
        try:
            us_graph = do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
        except Exception as e:  # some references allocate or sync; they get do_bench only
            print(f"  (no graph timing: {type(e).__name__})")
    return us, us_graph


def record(op: str, shape: str, nbytes: float, us: float, us_graph: float | None = None, **extra) -> None:
    best = min(us, us_graph) if us_graph else us
    row = dict(op=op, shape=shape, bytes=int(nbytes), us=round(us, 2))
    row["us_graph"] = round(us_graph, 2) if us_graph else None
    row["gbps"] = round(nbytes / us / 1e3, 1)
    row["pct_peak"] = round(100 * nbytes / us / 1e3 / PEAK_GBPS, 1)
    row["gbps_best"] = round(nbytes / best / 1e3, 1)
    row.update(extra)
    ROWS.append(row)
    print(json.dumps(row))


# ---- decode attention ------------------------------------------------------------------------


def decode_case(pool_k, pool_v, bs: int, ctx: int, sweep: bool, window: int = 0, kv_scales=None) -> None:
    """`kv_scales` (k_scale, v_scale): the pools are FP8 (e4m3) pages; the oracles read them dequantised."""
    pages_k, pages_v = pool_k, pool_v  # what the kernel reads (pool_k / pool_v become the oracles')
    blocks = ctx // PAGE
    perm = torch.randperm(pool_k.shape[0], device=DEV)[: bs * blocks]
    block_tables = perm.view(bs, blocks).int()
    q = torch.randn(bs, HQ, D, device=DEV, dtype=BF16)
    out = torch.empty_like(q)
    qsl = torch.arange(bs + 1, device=DEV, dtype=torch.int32)
    seq_lens = torch.full((bs,), ctx, device=DEV, dtype=torch.int32)
    scale = D**-0.5

    def ours(**kw):
        kw = dict(kw, sliding_window=window) if window else kw
        kw = dict(kw, kv_scales=kv_scales) if kv_scales else kw
        return lambda: paged_attention(q, pages_k, pages_v, out, qsl, seq_lens, block_tables, scale, 1, ctx, bs, **kw)

    # a window W: the query (at ctx - 1) sees the last W keys
    seen = min(ctx, window) if window else ctx
    mask = (torch.arange(ctx, device=DEV) >= ctx - seen)[None, None, None, :] if window else None

    if kv_scales:  # the oracles read bf16 pages of the values the FP8 pages hold
        elem = pool_k.element_size()
        pool_k, pool_v = ((p.to(BF16) * s.to(BF16)) for p, s in zip((pool_k, pool_v), kv_scales, strict=True))
    else:
        elem = 2

    def gathered():  # what a torch fallback does: gather the pages, then SDPA
        k = pool_k[block_tables].view(bs, ctx, HKV, D).transpose(1, 2)
        v = pool_v[block_tables].view(bs, ctx, HKV, D).transpose(1, 2)
        o = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return o[:, :, 0]

    ref = gathered()
    ours()()
    err = rel_err(out, ref)
    assert err < 1e-2, f"decode bs={bs} ctx={ctx}: rel err {err}"
    nbytes = 2 * bs * seen * HKV * D * elem + 2 * q.numel() * 2  # the K/V a query reads
    shape = f"bs={bs} ctx={ctx}" + (f" window={window}" if window else "") + (" kv=fp8" if kv_scales else "")
    us, us_graph = timed(ours())
    ref_us, _ = timed(gathered, graph=False)

    # oracle: FlashAttention (torch SDPA flash backend) on contiguous K/V, no paging
    k_c = pool_k[block_tables].view(bs, ctx, HKV, D)[:, ctx - seen :].transpose(1, 2).contiguous()
    v_c = pool_v[block_tables].view(bs, ctx, HKV, D)[:, ctx - seen :].transpose(1, 2).contiguous()

    def flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q[:, :, None], k_c, v_c, scale=scale, enable_gqa=True)

    try:
        flash_us = timed(flash, graph=False)[0]
    except RuntimeError as e:
        print(f"  flash oracle unavailable: {e}")
        flash_us = None
    extra = dict(rel_err=round(err, 5), sdpa_gathered_us=round(ref_us, 2))
    if kv_scales:  # the kernel's fp16 dots (its default for bf16 q) against widening the tiles to bf16
        extra["bf16_dots_us_graph"] = round(timed(ours(fp8_f16_dots=False))[1] or 0.0, 2)
    extra["flash_contig_us"] = round(flash_us, 2) if flash_us else None
    extra["vs_flash"] = round(us / flash_us, 2) if flash_us else None

    if sweep:  # grid over the tuning knobs, timed in CUDA graphs like the model runs them
        best = (us_graph or us, "default")
        grid = []
        for tile_n, warps, stages, segs in itertools.product((64, 128), (4, 8), (2, 3, 4), (1, 2, 4, 8, 16, 32)):
            kw = dict(tile_n=tile_n, num_warps=warps, num_stages=stages, num_segments=segs)
            try:
                t = do_bench_cudagraph(ours(**kw), rep=20, return_mode="median") * 1e3
            except Exception as e:  # e.g. out of shared memory
                print(f"  skip {kw}: {type(e).__name__}")
                continue
            grid.append(dict(kw, us_graph=round(t, 2)))
            if t < best[0]:
                best = (t, " ".join(f"{k}={v}" for k, v in kw.items()))
        extra["sweep"] = grid
        extra.update(sweep_best_us=round(best[0], 2), sweep_best=best[1])
    record("decode_attention", shape, nbytes, us, us_graph, **extra)


def bench_decode(batches, contexts, sweep: bool, window: int = 0, kv_fp8: bool = False) -> None:
    bench_decode_pairs(list(itertools.product(batches, contexts)), sweep, window, kv_fp8)


def bench_decode_pairs(pairs, sweep: bool, window: int = 0, kv_fp8: bool = False) -> None:
    need = max(b * c for b, c in pairs) // PAGE
    num_blocks = int(need * 1.25)  # a pool larger than the batch, so pages are scattered
    pool_k = torch.randn(num_blocks, PAGE, HKV, D, device=DEV, dtype=BF16)
    pool_v = torch.randn(num_blocks, PAGE, HKV, D, device=DEV, dtype=BF16)
    kv_scales = None
    if kv_fp8:  # e4m3 pages (--kv-cache-dtype fp8), scaled so randn's range uses e4m3's
        kv_scales = (torch.tensor([0.02], device=DEV), torch.tensor([0.02], device=DEV))
        pool_k, pool_v = (
            (p.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)
            for p, s in zip((pool_k, pool_v), kv_scales, strict=True)
        )
    for bs, ctx in pairs:
        decode_case(pool_k, pool_v, bs, ctx, sweep, window, kv_scales)
        torch.cuda.empty_cache()


def bench_prefill(lengths) -> None:
    for n in lengths:
        prefill_case(n)


def prefill_case(n: int) -> None:
    blocks = n // PAGE
    k_cache = torch.randn(blocks, PAGE, HKV, D, device=DEV, dtype=BF16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(n, HQ, D, device=DEV, dtype=BF16)
    out = torch.empty_like(q)
    bt = torch.arange(blocks, device=DEV, dtype=torch.int32)[None]
    qsl = torch.tensor([0, n], device=DEV, dtype=torch.int32)
    sl = torch.tensor([n], device=DEV, dtype=torch.int32)
    fn = lambda: paged_attention(q, k_cache, v_cache, out, qsl, sl, bt, D**-0.5, n, n, 1)  # noqa: E731
    k = k_cache.view(1, n, HKV, D).transpose(1, 2)
    v = v_cache.view(1, n, HKV, D).transpose(1, 2)
    qt = q.transpose(0, 1)[None]

    def flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qt, k, v, is_causal=True, enable_gqa=True)

    fn()
    err = rel_err(out, flash()[0].transpose(0, 1))
    assert err < 1e-2, f"prefill {n}: rel err {err}"
    us = timed(fn, graph=False)[0]
    flash_us = timed(flash, graph=False)[0]
    flops = 2 * 2 * HQ * D * n * n / 2  # causal: half of QK^T and PV
    nbytes = 2 * q.numel() * 2 + 2 * k_cache.numel() * 2
    record(
        "prefill_attention", f"len={n}", nbytes, us, None, rel_err=round(err, 5),
        tflops=round(flops / us / 1e6, 1), flash_contig_us=round(flash_us, 2),
        flash_tflops=round(flops / flash_us / 1e6, 1), vs_flash=round(us / flash_us, 2),
    )  # fmt: skip


# ---- fused elementwise kernels ----------------------------------------------------------------


def bench_norm(tokens) -> None:
    for t in tokens:
        norm_case(t)


def norm_case(t: int) -> None:
    x, r = (torch.randn(t, HIDDEN, device=DEV, dtype=BF16) for _ in range(2))
    w = torch.randn(HIDDEN, device=DEV, dtype=BF16)
    out, res = torch.empty_like(x), torch.empty_like(x)

    def torch_ref():
        s = x + r
        sf = s.float()
        return w * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(BF16), s

    fused_add_rms_norm(x, r, w, 1e-5, out=out, residual_out=res)
    ref, ref_res = torch_ref()
    assert torch.equal(res, ref_res) and rel_err(out, ref) < 1e-2
    us, us_graph = timed(lambda: fused_add_rms_norm(x, r, w, 1e-5, out=out, residual_out=res))
    nbytes = 4 * x.numel() * 2 + w.numel() * 2
    record(
        "add_rms_norm",
        f"T={t} H={HIDDEN}",
        nbytes,
        us,
        us_graph,
        torch_us=round(timed(torch_ref, False)[0], 2),
    )


def bench_rope(tokens) -> None:
    for t in tokens:
        rope_case(t)
        rope_case(t, qk_norm=True)  # Qwen3: per-head q/k RMSNorm in the same kernel


def rope_case(t: int, qk_norm: bool = False) -> None:
    cs = torch.randn(8192, D, device=DEV, dtype=torch.float32)
    q = torch.randn(t, HQ, D, device=DEV, dtype=BF16)
    k, v = (torch.randn(t, HKV, D, device=DEV, dtype=BF16) for _ in range(2))
    num_blocks = max(64, 2 * t // PAGE)
    kc, vc = (torch.zeros(num_blocks, PAGE, HKV, D, device=DEV, dtype=BF16) for _ in range(2))
    pos = torch.randint(0, 8192, (t,), device=DEV)
    slots = torch.randperm(num_blocks * PAGE, device=DEV)[:t]
    w = torch.rand(D, device=DEV, dtype=BF16) + 0.5
    norm = (w, 1e-6, w, 1e-6) if qk_norm else None
    fn = lambda: rope_and_write_kv(pos, q, k, v, cs, kc, vc, slots, qk_norm=norm)  # noqa: E731
    fn()
    assert torch.equal(kc.view(-1, HKV, D)[slots], k) and torch.equal(vc.view(-1, HKV, D)[slots], v)
    us, us_graph = timed(fn)
    # read q, k, v, positions, slots and cos/sin rows; write q, k, and k, v into the cache
    nbytes = (2 * q.numel() + 5 * k.numel()) * 2 + t * (16 + D * 4)
    record("qk_norm_rope_kv_write" if qk_norm else "rope_kv_write", f"T={t}", nbytes, us, us_graph)


def bench_silu(tokens) -> None:
    for t in tokens:
        silu_case(t)


def silu_case(t: int) -> None:
    x = torch.randn(t, 2 * INTER, device=DEV, dtype=BF16)
    out = torch.empty(t, INTER, device=DEV, dtype=BF16)
    torch_ref = lambda: F.silu(x[:, :INTER]) * x[:, INTER:]  # noqa: E731
    silu_and_mul(x, out=out)
    assert rel_err(out, torch_ref()) < 1e-2
    us, us_graph = timed(lambda: silu_and_mul(x, out=out))
    nbytes = x.numel() * 2 + out.numel() * 2
    record(
        "silu_and_mul",
        f"T={t} I={INTER}",
        nbytes,
        us,
        us_graph,
        torch_us=round(timed(torch_ref, False)[0], 2),
    )


# ---- skinny GEMM (decode linears) -----------------------------------------------------------

GEMV_SHAPES = {  # Llama-3.1-8B: name -> (N, K)
    "qkv": (HQ * D + 2 * HKV * D, HIDDEN),
    "o": (HIDDEN, HQ * D),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
    "lm_head": (128256, HIDDEN),
}


def bench_gemv(ms, sweep: bool) -> None:
    for name, (n, k) in GEMV_SHAPES.items():
        w = torch.randn(n, k, device=DEV, dtype=BF16) / k**0.5
        for m in ms:
            gemv_case(name, w, m, sweep)


def gemv_case(name: str, w: torch.Tensor, m: int, sweep: bool) -> None:
    n, k = w.shape
    x = torch.randn(m, k, device=DEV, dtype=BF16)
    ref = F.linear(x, w)
    assert rel_err(gemv(x, w), ref) < 1e-2
    nbytes = w.numel() * 2 + x.numel() * 2 + m * n * 2
    cublas_us, cublas_graph = timed(lambda: F.linear(x, w))
    us, us_graph = timed(lambda: gemv(x, w))
    extra = {}
    if sweep:
        best = (us_graph or us, "default")
        for bn, bk, sk, nw in itertools.product([16, 32, 64], [256, 512], [1, 2, 4], [4, 8]):
            kw = dict(block_n=bn, block_k=bk, split_k=sk, num_warps=nw)
            try:
                assert rel_err(gemv(x, w, **kw), ref) < 1e-2
            except triton.runtime.errors.OutOfResources:
                continue  # a tile too large for this GPU's shared memory: not a candidate
            t = timed(lambda kw=kw: gemv(x, w, **kw))[1]
            if t is not None and t < best[0]:
                best = (t, f"bn{bn} bk{bk} sk{sk} w{nw}")
        extra = dict(sweep_best_us=round(best[0], 2), sweep_best=best[1])
    cublas_best = min(t for t in (cublas_us, cublas_graph) if t)
    record(
        f"gemv {name}", f"M={m} N={n} K={k}", nbytes, us, us_graph,
        cublas_us=round(cublas_best, 2), cublas_pct_peak=round(100 * nbytes / cublas_best / 1e3 / PEAK_GBPS, 1),
        **extra,
    )  # fmt: skip


def _per_call_us(fn, x, ws) -> float:
    return do_bench_cudagraph(lambda: [fn(x, w) for w in ws], rep=50, return_mode="median") * 1e3 / len(ws)


def bench_gemv_cold(names, sweep: bool) -> None:
    """M = 1 GEMMs as the model sees them: back to back in a CUDA graph over enough copies of the
    weight that none is in L2 (the model streams 15 GB between two uses of one weight)."""
    for name in names:
        n, k = GEMV_SHAPES[name]
        copies = max(2, -(-320 * 2**20 // (n * k * 2)))
        ws = [torch.randn(n, k, device=DEV, dtype=BF16) / k**0.5 for _ in range(copies)]
        x = torch.randn(1, k, device=DEV, dtype=BF16)
        ref = F.linear(x, ws[0])

        cublas = _per_call_us(F.linear, x, ws)
        configs = [dict(kernel="reduce", block_n=16, block_k=1024, num_warps=4)]
        if sweep:
            configs = [
                dict(kernel="reduce", block_n=bn, block_k=bk, num_warps=nw)
                for bn, bk, nw in itertools.product((2, 4, 8, 16), (512, 1024, 2048), (4, 8))
            ]
            dots = itertools.product((16, 32, 64), (256, 512))
            configs += [dict(kernel="dot", block_n=bn, block_k=bk) for bn, bk in dots]
        best = (float("inf"), None)
        for kw in configs:
            try:
                assert rel_err(gemv(x, ws[0], **kw), ref) < 1e-2, kw
                t = _per_call_us(lambda a, b, kw=kw: gemv(a, b, **kw), x, ws)
            except triton.runtime.errors.OutOfResources:
                continue
            if t < best[0]:
                best = (t, kw)
        nbytes = n * k * 2 + k * 2 + n * 2
        label = " ".join(f"{key}={v}" for key, v in best[1].items())
        record(
            f"gemv_cold {name}", f"M=1 N={n} K={k}", nbytes, best[0], None,
            cublas_us=round(cublas, 2), cublas_pct_peak=round(100 * nbytes / cublas / 1e3 / PEAK_GBPS, 1),
            sweep_best_us=round(best[0], 2), sweep_best=label,
        )  # fmt: skip
        del ws
        torch.cuda.empty_cache()


# ---- greedy argmax (the sampler) ------------------------------------------------------------

ARGMAX_VOCABS = (128256, 151936, 102400)  # Llama-3, Qwen2/3, DeepSeek-V2


def bench_argmax(rows_list) -> None:
    for vocab in ARGMAX_VOCABS:
        for rows in rows_list:
            argmax_case(rows, vocab)


def argmax_case(rows: int, vocab: int) -> None:
    x = torch.randn(rows, vocab, device=DEV, dtype=BF16)
    x[:, vocab // 3] = x[:, -1] = 100.0  # a tie across chunks: both must answer vocab // 3
    torch_ref = lambda: x.argmax(dim=-1)  # noqa: E731
    assert torch.equal(argmax_rows(x), torch_ref())
    us, us_graph = timed(lambda: argmax_rows(x))
    torch_us, torch_graph = timed(torch_ref)
    record(
        "argmax", f"rows={rows} V={vocab}", x.numel() * 2 + rows * 8, us, us_graph,
        torch_us=round(torch_us, 2), torch_us_graph=round(torch_graph, 2) if torch_graph else None,
    )  # fmt: skip


def markdown() -> str:
    cols = [
        "op",
        "shape",
        "us",
        "us_graph",
        "gbps",
        "pct_peak",
        "gbps_best",
        "sdpa_gathered_us",
        "flash_contig_us",
        "vs_flash",
    ]
    cols += ["torch_us", "torch_us_graph", "cublas_us", "cublas_pct_peak", "tflops", "sweep_best_us", "sweep_best"]
    cols = [c for c in cols if any(r.get(c) is not None for r in ROWS)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in ROWS:
        lines.append("| " + " | ".join("" if r.get(c) is None else str(r[c]) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--sweep", action="store_true", help="sweep decode tile/warps/stages")
    ap.add_argument("--only", default="decode,prefill,norm,rope,silu,gemv,argmax", help="also: gemv_cold")
    ap.add_argument("--gemv-shapes", default="qkv,o,gate_up,down,lm_head", help="for gemv_cold")
    ap.add_argument("--decode-shapes", default=None, help="bs:ctx pairs for decode, e.g. 8:4096,64:1024")
    ap.add_argument("--window", type=int, default=0, help="decode with a sliding window of this many keys")
    ap.add_argument("--kv-fp8", action="store_true", help="decode over FP8 (e4m3) KV pages")
    args = ap.parse_args()
    only = set(args.only.split(","))
    torch.manual_seed(0)
    batches, contexts = ([1, 64], [1024, 16384]) if args.quick else ([1, 8, 64], [1024, 4096, 16384])
    tokens = [1, 64, 4096]
    if "decode" in only:
        if args.decode_shapes:
            pairs = [tuple(int(v) for v in p.split(":")) for p in args.decode_shapes.split(",")]
            bench_decode_pairs(pairs, args.sweep, args.window, args.kv_fp8)
        else:
            bench_decode(batches, contexts, args.sweep, args.window, args.kv_fp8)
    if "prefill" in only:
        bench_prefill([1024] if args.quick else [1024, 4096])
    if "norm" in only:
        bench_norm(tokens)
    if "rope" in only:
        bench_rope(tokens)
    if "silu" in only:
        bench_silu(tokens)
    if "gemv" in only:
        bench_gemv([1, 8] if args.quick else [1, 4, 8, 16], args.sweep)
    if "gemv_cold" in only:
        bench_gemv_cold(args.gemv_shapes.split(","), args.sweep)
    if "argmax" in only:
        bench_argmax([1, 8] if args.quick else [1, 8, 64])
    meta = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        python=platform.python_version(), peak_gbps=PEAK_GBPS,
    )  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, results=ROWS), indent=1))
    md = f"# Kernel microbenchmarks\n\n{meta}\n\n" + markdown()
    args.out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
