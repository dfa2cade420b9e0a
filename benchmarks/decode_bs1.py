"""Batch-1 decode (128 tokens in, 512 out): atomc next to transformers (static cache, auto torch.compile).

Each engine runs in its own subprocess on the same GPU, one after the other. Weights are random
(bf16) with the real model shape, so bytes moved per token are the real ones. The roofline is
weight bytes per token over the copy bandwidth measured in the same call (`ceilings.py`).

    python benchmarks/decode_bs1.py --model llama-3.1-8b --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ceilings  # noqa: E402
from checkpoints import make_checkpoint, weight_bytes  # noqa: E402

PROMPT_LEN, OUTPUT_LEN = 128, 512


def prompt_ids(n: int, vocab: int) -> list[int]:
    """n token ids from 1000 on (wrapped into a small vocabulary)."""
    return [(1000 + i) % vocab for i in range(n)]


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_atomc(
    model_dir: str, enforce_eager: bool, device: str = "cuda", prompt_len: int = PROMPT_LEN,
    output_len: int = OUTPUT_LEN, vocab: int = 1 << 30,
) -> dict:  # fmt: skip
    from atomc import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=model_dir,
        dtype="bfloat16" if device.startswith("cuda") else "float32",
        device=device,
        load_format="dummy",
        max_model_len=1024,
        max_num_seqs=8,
        enforce_eager=enforce_eager,
    )
    startup = time.perf_counter() - t0
    prompt = {"prompt_token_ids": prompt_ids(prompt_len, vocab)}
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))  # warm-up
    _sync(device)
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))[0]
        total = time.perf_counter() - t0
        m = out.metrics
        decode = m["finish_time"] - m["first_token_time"]
        runs.append({"total_s": total, "decode_tok_s": (output_len - 1) / decode, "e2e_tok_s": output_len / total})
    best = max(runs, key=lambda r: r["decode_tok_s"])
    return {"engine": "atomc" + (" (eager)" if enforce_eager else ""), "startup_s": startup, **best, "runs": runs}


def run_hf(
    model_dir: str, device: str = "cuda", prompt_len: int = PROMPT_LEN, output_len: int = OUTPUT_LEN,
    vocab: int = 1 << 30,
) -> dict:  # fmt: skip
    import torch
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    t0 = time.perf_counter()
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    # a static cache makes generate() compile the forward itself (fullgraph, reduce-overhead)
    ids = torch.tensor(prompt_ids(prompt_len, vocab), device=device)[None]
    gen = dict(do_sample=False, cache_implementation="static", pad_token_id=0)
    for _ in range(2):  # compile + capture
        model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **gen)
    startup = time.perf_counter() - t0
    runs = []
    for _ in range(3):
        _sync(device)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **gen)
        _sync(device)
        total = time.perf_counter() - t0
        runs.append({"total_s": total, "e2e_tok_s": output_len / total})
    best = max(runs, key=lambda r: r["e2e_tok_s"])
    return {"engine": "transformers static cache (generate compiles it)", "startup_s": startup, **best, "runs": runs}


def run_hf_loop(model_dir: str) -> dict:
    """gpt-fast style: a static cache and a hand-written decode loop over a torch.compile'd step."""
    import torch
    import transformers
    from transformers import StaticCache

    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    cache = StaticCache(config=cfg, max_cache_len=PROMPT_LEN + OUTPUT_LEN + 8)

    def step(ids, pos):
        return model(input_ids=ids, cache_position=pos, past_key_values=cache, use_cache=True).logits[:, -1]

    step_c = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    ids = torch.arange(1000, 1000 + PROMPT_LEN, device="cuda")[None]

    @torch.inference_mode()
    def generate() -> None:
        cache.reset()
        tok = step(ids, torch.arange(PROMPT_LEN, device="cuda")).argmax(-1, keepdim=True)
        for i in range(OUTPUT_LEN - 1):
            torch.compiler.cudagraph_mark_step_begin()
            tok = step_c(tok, torch.tensor([PROMPT_LEN + i], device="cuda")).argmax(-1, keepdim=True).clone()
        torch.cuda.synchronize()

    for _ in range(2):
        generate()
    startup = time.perf_counter() - t0
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        generate()
        total = time.perf_counter() - t0
        runs.append({"total_s": total, "e2e_tok_s": OUTPUT_LEN / total})
    best = max(runs, key=lambda r: r["e2e_tok_s"])
    return {"engine": "transformers static cache + torch.compile loop", "startup_s": startup, **best, "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--root", default="/tmp/atomc-bench-models")
    ap.add_argument("--engines", default="atomc,hf")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    model_dir = str(make_checkpoint(args.model, Path(args.root)))
    if args.child:
        res = {
            "atomc": lambda: run_atomc(model_dir, False),
            "atomc-eager": lambda: run_atomc(model_dir, True),
            "hf": lambda: run_hf(model_dir),
            "hf-loop": lambda: run_hf_loop(model_dir),
        }[args.child]()
        print("RESULT " + json.dumps(res))
        return
    bw = ceilings.measure()["bandwidth"]
    roofline = bw / weight_bytes(args.model)
    results = {"model": args.model, "bandwidth_TBps": bw / 1e12, "roofline_tok_s": roofline, "engines": []}
    for engine in args.engines.split(","):
        proc = subprocess.run(
            [sys.executable, __file__, "--model", args.model, "--root", args.root, "--child", engine],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            results["engines"].append({"engine": engine, "error": proc.stderr[-3000:]})
            continue
        res = json.loads(lines[-1][len("RESULT ") :])
        rate = res.get("decode_tok_s", res["e2e_tok_s"])
        res["roofline_pct"] = 100 * rate / roofline
        results["engines"].append(res)
    print(json.dumps(results, indent=2))
    print(f"\n{args.model} batch-1 decode, roofline {roofline:.0f} tok/s at {bw / 1e12:.2f} TB/s")
    for r in results["engines"]:
        if "error" in r:
            print(f"  {r['engine']:45s} ERROR {r['error'][-300:]}")
        else:
            print(
                f"  {r['engine']:45s} decode {r.get('decode_tok_s', r['e2e_tok_s']):7.1f} tok/s "
                f"({r['roofline_pct']:.0f}% of roofline), e2e {r['e2e_tok_s']:.1f} tok/s, "
                f"startup {r['startup_s']:.1f} s"
            )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
