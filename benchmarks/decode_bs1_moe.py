"""Batch-1 decode of the mixture-of-experts shapes against the active-weight roofline: atomc next to
its peers in the same call, each engine in its own process, one after the other (Mixtral-8x7B's
93 GB of bf16 weights fit the GPU once, so no two engines hold weights at the same time).

- atomc: 128 tokens in, 512 out, greedy; decode tok/s from the request's first token to its last,
  best of 3 after a warm-up (`decode_bs1.run_atomc`). `atomc-fp8` (and `atomc-fp8-eager`): the same
  with `--quantization fp8` (models/quant/fp8_moe.py: the experts quantised per row at load and run
  weight-only by atomc::moe_quant "fp8_channel", the linears FP8 with per-token activations).
- gpt-fast's Mixtral example (`peers/gpt_fast_mixtral.py`; needs `.peers/gpt-fast/`, see
  `peers/fetch_gpt_fast.sh`): 8 tokens in, 512 out, its own compile and timing.
- transformers with a static cache, `generate` compiling the forward (`decode_bs1.run_hf`): 128 in,
  512 out, end to end. DeepSeek-V2 too: transformers 5.x caches its latent (c_kv as a one-head
  key, k_pe as a one-head value; StaticCache sizes its layers from the first update) and marks the
  model fullgraph-compilable, so it takes the same static path (run on the CPU, where generate does
  not compile; the compiled GPU run is not checked yet).

Random weights with the real shapes (`checkpoints.py`), bf16. The roofline (`ceilings.py`) is the
bytes one token reads (non-expert weights, top_k experts per layer, KV at mid-output; for DeepSeek
the MLA weights, shared experts, dense first layers and the latent cache) over the copy
bandwidth measured in the same call, counted per engine in its weights' format: bf16, or for the
FP8 engines the linears and experts at a byte a value plus fp32 row scales (router, norms, lm_head
and KV bf16); `speedups` gives each FP8 engine's decode rate over its bf16 counterpart's.
`--tiny` runs the same code on the CPU with 2 small layers and a nominal bandwidth, to catch a
broken path before it costs GPU time. `--layers N` cuts the model to its first N layers (every
width kept, the roofline counted for the cut), so that a bf16 model and its FP8 twin both fit one
card: Mixtral-8x7B's 93 GB of bf16 do not fit an 80 GB H100, its first 20 layers do.

    python benchmarks/decode_bs1_moe.py --model mixtral-8x7b --out OUT/decode_bs1_mixtral-8x7b.json
    python benchmarks/decode_bs1_moe.py --model qwen3-30b-a3b --engines atomc,atomc-fp8 --out OUT/q.json
    python benchmarks/decode_bs1_moe.py --model qwen3-30b-a3b --tiny
    python benchmarks/decode_bs1_moe.py --model mixtral-8x7b --layers 20 --engines atomc-fp8,atomc  # 80 GB
    python benchmarks/decode_bs1_moe.py --model deepseek-v2-lite --out OUT/decode_bs1_deepseek-v2-lite.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import ceilings  # noqa: E402
import decode_bs1  # noqa: E402
from checkpoints import MOE_MODELS, make_checkpoint, model_config  # noqa: E402
from decode_bs1 import child_timeout, run_child  # noqa: E402,F401  (shared with decode_bs1.py)

PEERS = {
    "mixtral-8x7b": "atomc,gpt-fast", "qwen3-30b-a3b": "atomc,hf", "gpt-oss-20b": "atomc,hf",
    "gpt-oss-20b-mxfp4": "atomc", "deepseek-v2-lite": "atomc,hf",
}  # fmt: skip
TINY_LENS = (16, 24)  # prompt, output tokens under --tiny
NOMINAL_CPU_BANDWIDTH = decode_bs1.NOMINAL_CPU_BANDWIDTH
# engine -> (what runs, enforce_eager, weight format for the roofline): decode_bs1's, plus gpt-fast's Mixtral
ENGINES = {name: decode_bs1.ENGINES[name]
           for name in ("atomc", "atomc-eager", "atomc-no-pdl", "atomc-fp8", "atomc-fp8-eager",
                        "atomc-fp8-no-pdl", "atomc-ep", "hf", "hf-eager")}  # fmt: skip
ENGINES["gpt-fast"] = ("gpt-fast", None, "bf16")


def engine_table(cfg: dict) -> dict:
    """ENGINES with each engine's roofline format for this checkpoint: one shipped in MXFP4
    (gpt-oss-20b-mxfp4) runs its experts in MXFP4 in the atomc engines that keep its weights."""
    if (cfg.get("quantization_config") or {}).get("quant_method") != "mxfp4":
        return ENGINES
    return {
        e: (kind, eager, "mxfp4" if kind == "atomc" and w == "bf16" else w) for e, (kind, eager, w) in ENGINES.items()
    }


def child_command(args, engine: str) -> list[str]:
    if engine not in ENGINES:
        raise SystemExit(f"unknown engine {engine!r} (known: {', '.join(ENGINES)})")
    tp = getattr(args, "tensor_parallel_size", 1)
    if ENGINES[engine][0] != "atomc" and tp > 1:
        raise SystemExit(f"{engine} runs on one GPU: --tensor-parallel-size applies to the atomc engines only")
    if engine == "gpt-fast":
        if getattr(args, "layers", None):
            raise SystemExit("the gpt-fast peer builds the whole model: --layers applies to the other engines")
        if args.model != "mixtral-8x7b":
            raise SystemExit("the gpt-fast peer is its Mixtral example: --model mixtral-8x7b only")
        cmd = [sys.executable, str(HERE / "peers" / "gpt_fast_mixtral.py"), "--max-new-tokens", str(args.output_len)]
        return cmd + (["--tiny"] if args.tiny else [])
    cmd = [sys.executable, __file__, "--model", args.model, "--root", args.root, "--child", engine,
           "--tensor-parallel-size", str(tp)]  # fmt: skip
    layers = getattr(args, "layers", None)
    return cmd + (["--tiny"] if args.tiny else []) + (["--layers", str(layers)] if layers else [])


def run_engine_here(args, engine: str) -> dict:
    model_dir = str(make_checkpoint(args.model, Path(args.root), tiny=args.tiny, layers=args.layers))
    device = "cpu" if args.tiny else "cuda"
    vocab = model_config(args.model, args.tiny)["vocab_size"]
    lens = dict(prompt_len=args.prompt_len, output_len=args.output_len, vocab=vocab)
    kind = ENGINES[engine][0]
    if kind == "atomc":
        return decode_bs1.run_atomc_engine(engine, model_dir, device, tensor_parallel_size=args.tensor_parallel_size,
                                           **lens)  # fmt: skip
    if kind in ("hf", "hf-eager"):
        return decode_bs1.run_hf(model_dir, device=device, static_cache=kind == "hf", **lens)
    raise SystemExit(f"engine {engine!r} does not run in this script's process")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=MOE_MODELS)
    ap.add_argument("--root", default="/tmp/atomc-bench-models")
    ap.add_argument("--engines", default=None, help="default: atomc and the model's peer (" + str(PEERS) + ")")
    ap.add_argument("--budget", type=float, default=570, help="seconds for the whole run, from its start")
    ap.add_argument("--reserve", type=float, default=150, help="seconds kept back for each engine still to run")
    ap.add_argument("--bandwidth", type=float, default=None, help="bytes/s; default: measured (nominal with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="the same code on the CPU, 2 small layers, short prompts")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                    help="the atomc engines over N GPUs (atomc-ep: whole experts per rank); the roofline is then "
                         "N GPUs' bandwidth")  # fmt: skip
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="the model cut to its first N layers (widths kept): a bf16 / FP8 pair that fits one card",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    started = time.monotonic()
    args.prompt_len, args.output_len = TINY_LENS if args.tiny else (decode_bs1.PROMPT_LEN, decode_bs1.OUTPUT_LEN)
    if args.child:
        print("RESULT " + json.dumps(run_engine_here(args, args.child)), flush=True)
        return
    engines = (args.engines or PEERS[args.model]).split(",")
    for engine in engines:
        child_command(args, engine)  # an unknown engine fails before any GPU time is spent
    make_checkpoint(args.model, Path(args.root), tiny=args.tiny, layers=args.layers)  # once, before the children race
    cfg = model_config(args.model, args.tiny, args.layers)
    bw = args.bandwidth or (NOMINAL_CPU_BANDWIDTH if args.tiny else ceilings.measure()["bandwidth"])
    # the formats the engines run (bf16 always: the reference); DeepSeek has no FP8 count (nor FP8 run)
    table = engine_table(cfg)
    formats = ["bf16"] + sorted({table[e][2] for e in engines} - {"bf16"})
    tp = args.tensor_parallel_size  # each GPU reads its shard: N GPUs' bandwidth
    rooflines = {w: ceilings.moe_bs1_roofline(cfg, args.prompt_len, args.output_len, tp * bw, w) for w in formats}
    roofline = rooflines["bf16"]
    shape = ceilings.moe_shape(cfg)
    results = {
        "model": args.model + (" (tiny)" if args.tiny else "") + (f" ({args.layers} layers)" if args.layers else ""),
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "bandwidth_TBps": bw / 1e12,
        "tensor_parallel_size": tp,
        "active_GB": ceilings.moe_active_bytes(cfg, args.prompt_len + args.output_len // 2) / 1e9,
        "experts": f"top {shape.top_k} of {shape.experts}, {shape.sparse_layers} sparse layers"
        + (f", shared {shape.shared_inter // shape.expert_inter}" if shape.shared_inter else ""),
        "kv_bytes_per_token": ceilings.moe_kv_bytes(cfg, 1),  # all layers (MLA: the latent)
        "roofline_tok_s": roofline,
        "rooflines_tok_s": rooflines,
        "active_GB_by_weights": {
            w: ceilings.moe_active_bytes(cfg, args.prompt_len + args.output_len // 2, weights=w) / 1e9
            for w in rooflines
        },
        "weights_only_roofline_tok_s": bw / ceilings.moe_active_bytes(cfg),
        "engines": [],
        "speedups": {},
    }
    out = Path(args.out) if args.out else None
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
    for i, engine in enumerate(engines):
        log = out.with_name(f"{out.stem}.{engine}.log") if out else None
        timeout = child_timeout(args.budget, time.monotonic() - started, args.reserve, len(engines) - 1 - i)
        res, tail = run_child(child_command(args, engine), timeout, log)
        results["engines"].append(decode_bs1.engine_row(engine, res, tail, rooflines, table))
        results["speedups"] = decode_bs1.speedups(results["engines"])
        if out:  # after every engine: a later one failing or timing out keeps the numbers so far
            out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    ceiling = ", ".join(f"{v:.0f} tok/s {w}" for w, v in rooflines.items())
    print(f"\n{results['model']} batch-1 decode, {results['active_GB']:.3g} GB a token ({results['experts']}), "
          f"roofline {ceiling} at {tp} x {bw / 1e12:.2f} TB/s")  # fmt: skip
    for r in results["engines"]:
        if "error" in r:
            print(f"  {r['engine']:50s} ERROR {r['error'][-400:]}")
        else:
            kind = "decode" if "decode_tok_s" in r else "e2e"
            print(
                f"  {r['engine']:50s} {kind} {r.get('decode_tok_s', r['e2e_tok_s']):7.1f} tok/s "
                f"({r['roofline_pct']:.0f}% of its {r['weights']} roofline), e2e {r['e2e_tok_s']:.1f} tok/s, "
                f"startup {r['startup_s']:.1f} s"
            )
    for name, ratio in results["speedups"].items():
        print(f"  {name}: {ratio:.2f}x")
    sys.exit(1 if any("error" in r for r in results["engines"]) else 0)


if __name__ == "__main__":
    main()
