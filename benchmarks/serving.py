"""Serving at ISL/OSL 1024/1024 over a range of concurrencies: `atomc serve` measured by `atomc bench
serve`, next to transformers' continuous batching (`generate_batch`) at one of the same loads.

Random bf16 weights with the real model shape (`--load-format dummy`). Each cell is reported as a
share of the serving ceiling (prefill at the measured matmul rate plus decode steps at the measured
bandwidth; `ceilings.py` says how; for a mixture of experts a step reads the expected number of
distinct experts, `ceilings.moe_serving_ceiling`), with the decode-only bound beside it.

    python benchmarks/serving.py --conc 1,8,32,64,128 --out serving.json
    python benchmarks/serving.py --model qwen3-30b-a3b --tiny     # the same code on the CPU, toy sizes

Exits 1 when a cell did not complete every request or the peer failed (after writing the JSON).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]  # this tree first
import ceilings  # noqa: E402
from checkpoints import CONFIGS, make_checkpoint, model_config  # noqa: E402
from tree_env import child_env  # noqa: E402

from atomc.bench.sweep import free_port, server_command, stop_process_group, wait_until_healthy  # noqa: E402

# --tiny: a toy model on the CPU, short requests, nominal rates (the % are then smoke values only)
TINY = {"isl": 32, "osl": 16, "conc": [1, 4], "hf_conc": 4, "hf_osl": 8, "bandwidth": 20e9, "matmul_flops": 200e9}


def start_server(
    model_dir: str, port: int, max_seqs: int, max_len: int, log_path: Path, extra: list[str]
) -> subprocess.Popen:
    """`atomc serve` with random 8B weights, launched and awaited as `atomc bench sweep` does."""
    engine_args = [
        "--load-format", "dummy", "--max-model-len", str(max_len),
        "--max-num-seqs", str(max_seqs), "--max-num-batched-tokens", "8192", *extra,
    ]  # fmt: skip
    log = open(log_path, "w")  # noqa: SIM115 (lives as long as the server)
    cmd = server_command(model_dir, port, engine_args)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=child_env())
    wait_until_healthy(f"http://127.0.0.1:{port}", proc, 900, log_path)
    return proc


def server_formats(server_args: str, cfg: dict | None = None) -> tuple[str, int]:
    """(weight format, KV bytes a value) the server runs, for its ceiling: `--server-args`' flags,
    else the checkpoint's own `quantization_config` (`cfg`: GPT-OSS's MXFP4 experts)."""
    words = server_args.replace("=", " ").split()

    def flag(name: str) -> str | None:
        return words[words.index(name) + 1] if name in words[:-1] else None

    published = ((cfg or {}).get("quantization_config") or {}).get("quant_method")
    weights = "fp8" if flag("--quantization") == "fp8" else published if published in ("mxfp4", "fp8") else "bf16"
    kv = 1 if flag("--kv-cache-dtype") in ("fp8", "fp8_e4m3") else 2
    return weights, kv


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f} ms"


def late_compiles(server_log: Path) -> int:
    """Lines the server logged for a Triton compile after its start-up (each a stall of the run)."""
    from atomc.kernels.triton.compile_watch import MARK

    return server_log.read_text(errors="replace").count(MARK) if server_log.exists() else 0


def run_atomc(args, model_dir: str, out_dir: Path, on_cell=None) -> list[dict]:
    """The cells against one `atomc serve`; `on_cell(rows)` after each (to save what is measured)."""
    from atomc.bench.serve import BenchConfig, run_benchmark

    port = free_port()
    max_seqs = max(args.conc)
    t0 = time.perf_counter()
    dtype = ["--dtype", "float32" if args.tiny else "bfloat16"]
    server_log = out_dir / "server.log"
    proc = start_server(
        model_dir, port, max_seqs, args.isl + args.osl + 16, server_log, dtype + args.server_args.split()
    )
    startup = time.perf_counter() - t0
    rows = []
    try:
        for i, conc in enumerate(args.conc):
            # a seed per cell: the cells share one server, and repeated prompts would hit the prefix cache
            cfg = BenchConfig(
                base_url=f"http://127.0.0.1:{port}", input_len=args.isl, output_len=args.osl,
                num_prompts=max(conc * args.waves, 2), max_concurrency=conc,
                vocab_size=model_config(args.model, args.tiny)["vocab_size"], show_progress=False, seed=1 + i,
                num_warmups=conc if args.warmups is None else args.warmups,
            )  # fmt: skip
            compiled_before = late_compiles(server_log)
            res = run_benchmark(cfg)
            res["conc"] = conc
            res["late_compiles"] = late_compiles(server_log) - compiled_before  # its warm-ups' included
            rows.append(res)
            if on_cell is not None:
                on_cell(rows)
            if res["completed"] < res["num_prompts"] or proc.poll() is not None:
                # keep the cells measured so far; a dead server fails every later cell anyway
                state = "exited" if proc.poll() is not None else "running"
                print(
                    f"atomc CONC={conc}: {res['failed']} of {res['num_prompts']} requests failed "
                    f"(server {state}); see server.log",
                    flush=True,
                )
                break
            print(
                f"atomc CONC={conc}: {res['output_throughput']:.0f} tok/s, "
                f"median TPOT {res['median_tpot_ms']:.2f} ms, median TTFT {res['median_ttft_ms']:.0f} ms, "
                f"Triton compiles while serving {res['late_compiles']}",
                flush=True,
            )
    finally:
        stop_process_group(proc)
    for r in rows:
        r["server_startup_s"] = startup
    return rows


def run_hf(args, model_dir: str, conc: int, osl: int) -> dict:
    import torch
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    gen = transformers.GenerationConfig(max_new_tokens=osl, do_sample=False, eos_token_id=-1, pad_token_id=0)
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randint(10, cfg.vocab_size, (args.isl,), generator=g).tolist() for _ in range(conc)]
    model.generate_batch(inputs=inputs[:2], generation_config=gen)  # warm-up
    t0 = time.perf_counter()
    out = model.generate_batch(inputs=inputs, generation_config=gen)
    dt = time.perf_counter() - t0
    tokens = sum(len(o.generated_tokens) for o in out.values())
    return {
        "engine": "transformers generate_batch",
        "conc": conc,
        "output_len": osl,
        "output_tokens": tokens,
        "duration": dt,
        "output_throughput": tokens / dt,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--root", default="/tmp/atomc-bench-models")
    ap.add_argument("--conc", default="1,8,32,64,128")
    ap.add_argument("--isl", type=int, default=1024)
    ap.add_argument("--osl", type=int, default=1024)
    ap.add_argument("--waves", type=int, default=1, help="prompts per cell = waves x concurrency")
    ap.add_argument("--warmups", type=int, default=None, help="unmeasured requests per cell; default: CONC")
    ap.add_argument("--hf-conc", type=int, default=64)
    ap.add_argument("--hf-osl", type=int, default=128, help="transformers is slow: fewer output tokens")
    ap.add_argument("--bandwidth", type=float, default=None, help="bytes/s; default: measured")
    ap.add_argument("--matmul-flops", type=float, default=None, help="bf16 FLOP/s; default: measured")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--server-args", default="", help="extra `atomc serve` flags, e.g. '--engine-process off'")
    ap.add_argument("--out", default="serving.json")
    ap.add_argument("--tiny", action="store_true", help="toy model on the CPU: " + str(TINY))
    args = ap.parse_args()
    if args.model not in CONFIGS:
        raise SystemExit(f"unknown --model {args.model!r}; known: {', '.join(CONFIGS)}")
    if args.tiny:  # the sizes a CPU runs in seconds, unless given
        given = set(sys.argv)
        args.isl = args.isl if "--isl" in given else TINY["isl"]
        args.osl = args.osl if "--osl" in given else TINY["osl"]
        args.conc = args.conc if "--conc" in given else ",".join(map(str, TINY["conc"]))
        args.hf_conc = args.hf_conc if "--hf-conc" in given else TINY["hf_conc"]
        args.hf_osl = args.hf_osl if "--hf-osl" in given else TINY["hf_osl"]
        args.bandwidth = args.bandwidth or TINY["bandwidth"]
        args.matmul_flops = args.matmul_flops or TINY["matmul_flops"]
    args.conc = [int(c) for c in args.conc.split(",")]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model_dir = str(make_checkpoint(args.model, Path(args.root), tiny=args.tiny))
    cfg = model_config(args.model, args.tiny)
    peaks = ceilings.measure() if args.bandwidth is None or args.matmul_flops is None else {}
    bw = args.bandwidth or peaks["bandwidth"]
    flops = args.matmul_flops or peaks["matmul_flops"]
    result = {"model": args.model + (" (tiny)" if args.tiny else ""), "isl": args.isl, "osl": args.osl,
              "bandwidth": bw, "matmul_flops": flops}  # fmt: skip

    weights, kv_dtype_bytes = server_formats(args.server_args, cfg)
    result.update(weights=weights, kv_dtype_bytes=kv_dtype_bytes)

    def save(rows: list[dict]) -> None:  # after every cell: a run stopped later keeps the cells measured
        for r in rows:
            r.update(ceilings.serving_bounds(cfg, r["conc"], args.isl, args.osl, bw, flops, weights, kv_dtype_bytes))
            r["ceiling_pct"] = 100 * r["output_throughput"] / r["ceiling_tok_s"]
            r["decode_bound_pct"] = 100 * r["output_throughput"] / r["decode_bound_tok_s"]
        result["atomc"] = rows
        out.write_text(json.dumps(result, indent=2))

    try:
        save(run_atomc(args, model_dir, out.parent, on_cell=save))
    except Exception as e:  # a server that does not start: still run the peer, then exit 1
        result.setdefault("atomc", [])
        result["atomc_error"] = repr(e)[-3000:]
        print(f"atomc failed: {result['atomc_error']}", flush=True)
        out.write_text(json.dumps(result, indent=2))
    if not args.skip_hf:
        try:
            result["hf"] = run_hf(args, model_dir, args.hf_conc, args.hf_osl)
        except Exception as e:  # a peer failing must not lose atomc's numbers
            result["hf"] = {"error": repr(e)[-2000:]}
    out.write_text(json.dumps(result, indent=2))
    print(f"\n{args.model} serving ISL/OSL {args.isl}/{args.osl}, {bw / 1e12:.2f} TB/s, {flops / 1e12:.0f} TFLOP/s")
    for r in result["atomc"]:
        print(
            f"  atomc CONC={r['conc']:4d}  {r['output_throughput']:8.0f} tok/s  "
            f"({r['ceiling_pct']:.0f}% of ceiling {r['ceiling_tok_s']:.0f}, "
            f"{r['decode_bound_pct']:.0f}% of decode-only {r['decode_bound_tok_s']:.0f})  "
            f"TPOT p50 {_ms(r['median_tpot_ms'])}  "
            f"TTFT p50 {_ms(r['median_ttft_ms'])}  completed {r['completed']}/{r['num_prompts']}"
        )
        # a step's time and its spread: a stall (a kernel compiling mid-run) shows as a std far above the
        # p50 while the medians stay put (docs/performance.md section 27)
        itl = (_ms(r.get(k)) for k in ("median_itl_ms", "p99_itl_ms", "std_itl_ms"))
        print("{:14}ITL p50 {}  p99 {}  std {}".format("", *itl))
    print(f"  transformers: {json.dumps(result.get('hf'))}")
    incomplete = [r["conc"] for r in result["atomc"] if r["completed"] < r["num_prompts"]]
    missing = [c for c in args.conc if c not in {r["conc"] for r in result["atomc"]}]
    if incomplete or missing or "atomc_error" in result or "error" in result.get("hf", {}):
        print(f"  NOT ALL DONE: cells with failed requests {incomplete}, cells not run {missing}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
