"""Where a batch-1 decode step spends its GPU time: the kernels of one step, grouped by name, with
their count and time per step, and the step's GPU-busy time against its wall time (the gap is
launch and host overhead that CUDA graphs should hide). With PDL on (the default) a kernel is
launched while the one before it runs and its time includes that wait, so the times overlap and
add up to more than the step; `--no-pdl` gives each kernel's own time.

    python benchmarks/profile_decode.py --model qwen3-30b-a3b [--eager] [--steps 32] [--quantization fp8]
        [--no-pdl] [--out F.json]

Random weights with the real shapes (`checkpoints.py`), bf16, 128 tokens in. The profile covers
`--steps` decode steps after a warm-up; kernels launched inside a CUDA graph are listed when the
profiler sees into graphs (CUPTI does on recent drivers; `--eager` profiles without graphs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import decode_bs1  # noqa: E402
from checkpoints import CONFIGS, make_checkpoint, model_config  # noqa: E402


def kernel_table(prof, steps: int) -> list[dict]:
    per = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if getattr(ev, "device_type", None) is None or "cuda" not in str(ev.device_type).lower():
            continue
        dur = getattr(ev, "device_time", None) or getattr(ev, "cuda_time", 0.0)
        per[ev.name][0] += 1
        per[ev.name][1] += dur
    rows = [
        {"kernel": name, "per_step": n / steps, "us_per_step": us / steps, "us_each": us / max(n, 1)}
        for name, (n, us) in per.items()
    ]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(CONFIGS))
    ap.add_argument("--tiny", action="store_true", help="2 small layers on the CPU (a smoke test of this script)")
    ap.add_argument("--root", default="/tmp/atomc-bench-models")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--quantization", default=None, help="e.g. fp8: quantise the bf16 checkpoint at load")
    ap.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="profile rank 0 of N: its table shows the collectives' kernels (NCCL time a step)",
    )
    ap.add_argument(
        "--no-pdl", action="store_true", help="--no-enable-pdl: kernels do not overlap, so each one's time is its own"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from atomc import LLM, SamplingParams

    model_dir = str(make_checkpoint(args.model, Path(args.root), tiny=args.tiny))
    vocab = model_config(args.model, args.tiny)["vocab_size"]
    device = "cpu" if args.tiny else "cuda"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    llm = LLM(
        model=model_dir, dtype="float32" if args.tiny else "bfloat16", device=device, load_format="dummy",
        max_model_len=1024, max_num_seqs=8, enforce_eager=args.eager or args.tiny, quantization=args.quantization,
        tensor_parallel_size=args.tensor_parallel_size, enable_pdl=not args.no_pdl,
    )  # fmt: skip
    prompt = {"prompt_token_ids": decode_bs1.prompt_ids(16 if args.tiny else decode_bs1.PROMPT_LEN, vocab)}
    greedy = SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True)
    llm.generate(prompt, greedy)  # warm-up: compiles and captures
    sync()
    t0 = time.perf_counter()
    out = llm.generate(prompt, greedy)[0]
    m = out.metrics
    step_ms = 1e3 * (m["finish_time"] - m["first_token_time"]) / args.steps
    wall = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, greedy)
        sync()
    rows = kernel_table(prof, args.steps + 1)  # the prefill step is one of them: its kernels show once
    busy_us = sum(r["us_per_step"] for r in rows)
    result = {
        "model": args.model,
        "quantization": args.quantization,
        "tensor_parallel_size": args.tensor_parallel_size,
        "cuda_graphs": not args.eager,
        "pdl": not args.no_pdl,
        "decode_step_ms": step_ms,
        "request_wall_s": wall,
        "gpu_busy_us_per_step": busy_us,
        "kernels_per_step": sum(r["per_step"] for r in rows),
        "kernels": rows[:60],
    }
    print(json.dumps(result, indent=2))
    print(f"\n{args.model} {'eager' if args.eager else 'CUDA graphs'}: decode step {step_ms:.3f} ms, "
          f"GPU busy {busy_us / 1e3:.3f} ms in {result['kernels_per_step']:.0f} kernels a step")  # fmt: skip
    for r in rows[:40]:
        print(f"  {r['us_per_step']:8.1f} us  {r['per_step']:6.1f}x  {r['us_each']:7.2f} us each  {r['kernel'][:110]}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
