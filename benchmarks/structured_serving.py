"""TPOT under a JSON schema against unconstrained, on one `atomc serve` (issue 17's target: within 5%
at CONC 64, 1024/1024, 8B shape): the same load twice, the second with every request under
`structured_schema.json` (`atomc bench serve --structured-json-schema`). Random bf16 weights; the
synthetic tokenizer has the printable ASCII characters, so the schema can be spelled
(`checkpoints.py`), and `ignore_eos` keeps every request at its 1,024 tokens, constrained or not.

    python benchmarks/structured_serving.py --out-dir OUT [--tiny]

Writes `plain.json`, `schema.json` and `summary.json` (TPOT ratio) under OUT; exits 1 when a run
did not complete every request.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from checkpoints import make_checkpoint, model_config  # noqa: E402
from serving import start_server  # noqa: E402


def main() -> None:
    from atomc.bench.serve import BenchConfig, run_benchmark
    from atomc.bench.sweep import free_port, stop_process_group

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--root", default="/tmp/atomc-bench-models")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--conc", type=int, default=64)
    ap.add_argument("--isl", type=int, default=1024)
    ap.add_argument("--osl", type=int, default=1024)
    ap.add_argument("--schema", default=str(HERE / "structured_schema.json"))
    ap.add_argument("--tiny", action="store_true", help="a toy model on the CPU, short requests")
    args = ap.parse_args()
    if args.tiny:
        args.conc, args.isl, args.osl = 4, 32, 48
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = str(make_checkpoint(args.model, Path(args.root), tiny=args.tiny))
    schema = json.loads(Path(args.schema).read_text())
    port = free_port()
    t0 = time.perf_counter()
    dtype = ["--dtype", "float32" if args.tiny else "bfloat16"]
    proc = start_server(model_dir, port, args.conc, args.isl + args.osl + 16, out / "server.log", dtype)
    summary: dict = {"server_startup_s": round(time.perf_counter() - t0, 1)}
    ok = True
    try:
        for i, (name, extra) in enumerate((("plain", None), ("schema", {"structured_outputs": {"json": schema}}))):
            cfg = BenchConfig(
                base_url=f"http://127.0.0.1:{port}", input_len=args.isl, output_len=args.osl,
                num_prompts=args.conc, max_concurrency=args.conc, num_warmups=args.conc, seed=1 + i,
                vocab_size=min(1000, model_config(args.model, args.tiny)["vocab_size"]), show_progress=False,
                extra_body=extra,
            )  # fmt: skip
            res = run_benchmark(cfg)
            (out / f"{name}.json").write_text(json.dumps(res, indent=2))
            ok = ok and res["completed"] == res["num_prompts"] and res["total_output_tokens"] == args.conc * args.osl
            summary[name] = {k: res[k] for k in ("mean_tpot_ms", "p99_tpot_ms", "output_throughput", "completed")}
            print(name, json.dumps(summary[name]), flush=True)
    finally:
        stop_process_group(proc)
    if ok and "plain" in summary and "schema" in summary:
        summary["tpot_ratio"] = round(summary["schema"]["mean_tpot_ms"] / summary["plain"]["mean_tpot_ms"], 4)
        print("TPOT schema / plain:", summary["tpot_ratio"], flush=True)
    summary["model"] = model_config(args.model, args.tiny).get("architectures")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
