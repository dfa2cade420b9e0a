"""FP8 accuracy against the unquantised model, through `atomc serve` and lm-eval (issue 16's
accuracy item): the default model (SmolLM2-135M-Instruct, real weights) served as it is and with
`--quantization fp8` (online: per-channel weights, dynamic per-token activations), each scored by
lm-eval's `local-completions` model (the `accuracy` block's request, atomc/bench/blocks/accuracy.py)
on two offline tasks, and each asked for the per-token log-likelihoods of the same texts (`echo` +
`logprobs`, what lm-eval's loglikelihood requests read):

- `atomc_agreement` (atomc/bench/agreement.py): 500 English agreement minimal pairs, scored by
  log-likelihood (BLiMP's shape). The gated score: a 135M model is well above chance here (92%),
  so a point means something;
- `atomc_arith` (GSM8K-style, generated answers, exact match): reported, not gated. A 135M model
  scores near zero there, so its difference says little.

    python benchmarks/fp8_accuracy.py --out results/fp8_accuracy.json [--limit 100] [--model DIR]

Reports each run's scores, their differences in points, and the per-token log-likelihood
differences (mean, p99, max of |fp8 - reference| over every scored token). Runs on the CPU (the
FP8 linears then run atomc's dequantising reference, so the numbers are the format's, not a
kernel's) or on a GPU; the two servers run one after the other on one port. Exits 1 when a run
fails, 2 when a gate (the agreement score within 1 point, the stated log-likelihood bound) does
not hold.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import httpx

from atomc.bench.blocks import SuiteContext
from atomc.bench.blocks.accuracy import build_request, project, run_lm_eval
from atomc.bench.sweep import free_port, server_command, stop_process_group, wait_until_healthy
from atomc.env import cache_dir
from models.loader.default_model import resolve_model_path

MAX_POINTS = 1.0  # the bound on the score difference, in percentage points
GATED_SCORE = "atomc_agreement.acc__none"  # the score the points bound applies to
# per-token log-likelihood bound, stated before the first run: e4m3 keeps 3 mantissa bits, so each
# weight and activation moves by up to 2^-4 of itself, and a token's log-probability by a few
# hundredths on average. The default model measured 0.166 on the CPU (2026-12-02), the same to six
# digits as transformers with FP8 fake-quant linears (benchmarks/fp8_fake_quant_reference.py): the
# 135M model is that sensitive to the format; the bound is left as stated, and fails there
MAX_MEAN_ABS_LOGPROB = 0.05


def texts(limit: int) -> list[str]:
    """The task's own test documents, question and reference answer: what the scores are over."""
    data = Path(__file__).resolve().parent.parent / "atomc" / "bench" / "lm_eval_tasks" / "atomc_arith_test.jsonl"
    rows = [json.loads(line) for line in data.read_text().splitlines()[:limit]]
    return [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows]


def token_logprobs(base_url: str, model: str, text: str) -> tuple[list[str], list[float]]:
    body = {"model": model, "prompt": text, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    lp = r.json()["choices"][0]["logprobs"]
    n = len(lp["token_logprobs"]) - 1  # the last one is the generated token
    return lp["tokens"][1:n], lp["token_logprobs"][1:n]  # the first prompt token has no log-prob


def run_one(args, quantization: str | None, work: Path) -> dict:
    port = free_port()
    extra = ["--max-model-len", "2048", "--max-num-seqs", "8"]
    if quantization:
        extra += ["--quantization", quantization]
    if args.device:
        extra += ["--device", args.device]
    label = quantization or "reference"
    log_path = work / f"server_{label}.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            server_command(args.model, port, extra), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            base = f"http://127.0.0.1:{port}"
            wait_until_healthy(base, proc, 900, log_path)
            model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
            startup = time.perf_counter() - t0
            ctx = SuiteContext(base_url=base, model=model, out_dir=work, config_dir=work)
            tokenizer = str(resolve_model_path(args.model, cache_dir()))  # the served folder's tokenizer
            tasks = [
                {"id": "agreement", "task": "atomc_agreement", "limit": args.agreement_limit, "tokenizer": tokenizer},
                {"id": "arith", "task": "atomc_arith", "num_fewshot": args.num_fewshot, "limit": args.limit},
            ]
            scores, eval_s = {}, {}
            for task in tasks:
                t1 = time.perf_counter()
                request = build_request({**task, "num_concurrent": 8}, ctx)
                out = run_lm_eval(request, work / f"lm_eval_{label}_{task['id']}", args.timeout, print)
                scores.update(project(out["results"]))
                eval_s[task["id"]] = round(time.perf_counter() - t1, 1)
            scored = [token_logprobs(base, model, t) for t in texts(args.loglik_docs)]
        finally:
            stop_process_group(proc)
    return {"quantization": quantization, "startup_s": round(startup, 1), "eval_s": eval_s,
            "scores": scores, "scored": scored}  # fmt: skip


def compare(ref: dict, q: dict) -> dict:
    diffs, mismatched = [], 0
    for (rt, rl), (qt, ql) in zip(ref["scored"], q["scored"], strict=True):
        if rt != qt:  # the same text tokenises the same way; a mismatch would be a server bug
            mismatched += 1
            continue
        diffs += [abs(a - b) for a, b in zip(rl, ql, strict=True)]
    diffs.sort()
    points = {k: round(100 * (q["scores"][k] - ref["scores"][k]), 2) for k in ref["scores"] if k in q["scores"]}
    return {
        "points_difference": points,
        "gated_points": points.get(GATED_SCORE, math.nan),
        "tokens_scored": len(diffs),
        "docs_tokenised_differently": mismatched,
        "mean_abs_logprob_diff": sum(diffs) / max(len(diffs), 1),
        "p99_abs_logprob_diff": diffs[int(0.99 * (len(diffs) - 1))] if diffs else math.nan,
        "max_abs_logprob_diff": diffs[-1] if diffs else math.nan,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("results/fp8_accuracy.json"))
    ap.add_argument("--model", default=None, help="a model folder; default: atomc's default model")
    ap.add_argument("--quantization", default="fp8")
    ap.add_argument("--limit", type=int, default=100, help="atomc_arith problems scored")
    ap.add_argument("--agreement-limit", type=int, default=None, help="atomc_agreement pairs scored (default all 500)")
    ap.add_argument("--num-fewshot", type=int, default=3)
    ap.add_argument("--loglik-docs", type=int, default=50, help="documents whose tokens are scored")
    ap.add_argument("--device", default=None)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds for each lm-eval run")
    args = ap.parse_args()
    work = args.out.with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    runs = [run_one(args, None, work), run_one(args, args.quantization, work)]
    cmp = compare(*runs)
    gates = {
        f"{GATED_SCORE} within {MAX_POINTS} point": abs(cmp["gated_points"]) <= MAX_POINTS,
        f"mean |d logprob| <= {MAX_MEAN_ABS_LOGPROB}": cmp["mean_abs_logprob_diff"] <= MAX_MEAN_ABS_LOGPROB,
        "same tokens": cmp["docs_tokenised_differently"] == 0,
    }
    result = {"args": {k: str(v) for k, v in vars(args).items()},
              "runs": [{k: v for k, v in r.items() if k != "scored"} for r in runs],
              "comparison": cmp, "gates": gates}  # fmt: skip
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for r in runs:
        print(r["quantization"] or "reference", {k: round(v, 4) for k, v in r["scores"].items() if "stderr" not in k})
    print(json.dumps(cmp, indent=1))
    print("gates:", gates)
    sys.exit(0 if all(gates.values()) else 2)


if __name__ == "__main__":
    main()
