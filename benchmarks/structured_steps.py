"""Where a structured-output decode step spends its time: 64 requests decoding under a JSON schema
against the same 64 unconstrained, in one engine (8B shape, random weights, CUDA graphs, async
scheduling), stepped offline so each part of the step can be timed.

Per mode it reports the step wall time (median over `--steps` decode steps) and the host parts of a
step: schedule / launch / complete (the engine's `last_step`), and for constrained steps the bitmask
fill and the queueing of mask + sampling (`finish_sampling`), with the matchers' accept time inside
complete. `--sync-debug` also lists every call that synchronized the device during a few
constrained steps (torch's sync debug mode, with the Python stack of each), and `--trace DIR` writes a
profiler table (CPU and CUDA) of a few constrained steps.

    python benchmarks/structured_steps.py --out steps.json [--sync-debug] [--trace DIR]
    python benchmarks/structured_steps.py --tiny --device cpu   # the code path, on a CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from checkpoints import make_checkpoint  # noqa: E402


class Timed:
    """Wrap `obj.name` so each call's wall time is appended to `self.times`."""

    def __init__(self, obj, name: str):
        self.obj, self.name, self.fn, self.times = obj, name, getattr(obj, name), []

        def wrapped(*a, **k):
            t0 = time.perf_counter()
            try:
                return self.fn(*a, **k)
            finally:
                self.times.append(time.perf_counter() - t0)

        setattr(obj, name, wrapped)

    def take(self) -> list[float]:
        out, self.times = self.times, []
        return out


def ms(values) -> float | None:
    values = list(values)
    return round(1e3 * statistics.median(values), 3) if values else None


def use_variant(fill: str, apply: str) -> None:
    """A/B switches for this benchmark only: how the host fills the bitmask (`serial`: the engine's
    loop; `batch`: xgrammar's batch matcher with its default threads; `batchN`: N threads) and how
    the mask is applied (`engine`: the sampler's path, one kernel on a GPU; `torch`: the torch ops
    the CPU uses, on the device)."""
    import atomc.engine.structured_step as step_mod
    from atomc.engine import structured_outputs as so_mod
    from atomc.runtime import model_runner, sampler

    if fill == "serial":
        step_mod.fill_bitmask = so_mod.fill_bitmask
    else:
        xgr = so_mod._xgr()
        batch = xgr.BatchGrammarMatcher(int(fill[5:])) if fill[5:] else xgr.BatchGrammarMatcher()

        def fill_fn(grammars, bitmask, rows):
            live = [
                (r, g) for r, g in zip(rows, grammars, strict=True) if g is not None and not g.matcher.is_terminated()
            ]
            for r, g in zip(rows, grammars, strict=True):
                if g is None or g.matcher.is_terminated():
                    bitmask[r].fill_(-1)
            batch.batch_fill_next_token_bitmask([g.matcher for _, g in live], bitmask, [r for r, _ in live])

        step_mod.fill_bitmask = fill_fn
    if apply == "engine":
        model_runner.apply_token_bitmask = sampler.apply_token_bitmask
    else:

        def apply_fn(logits, bitmask, rows=None):
            rows = list(range(logits.shape[0])) if rows is None else list(rows)
            sampler.mask_with_torch(logits, bitmask.to(logits.device, non_blocking=True), rows)

        model_runner.apply_token_bitmask = apply_fn


def run_mode(eng, mode: str, prefix: str, args, schema: dict, timers: dict) -> dict:
    from atomc import SamplingParams
    from atomc.sampling_params import StructuredOutputsParams

    mode, _, variant = mode.partition(":")
    opts = dict(kv.split("=") for kv in variant.split("+") if kv)
    use_variant(opts.get("fill", "serial"), opts.get("apply", "engine"))

    n = args.num_seqs
    for i in range(n):
        so = StructuredOutputsParams(json=schema) if mode == "schema" else None
        eng.add_request(
            f"{prefix}-{i}",
            [3 + (7 * i + j) % 90 for j in range(args.prompt_len)],
            SamplingParams(temperature=0, max_tokens=args.steps + 64, ignore_eos=True, structured_outputs=so),
        )
    while eng.scheduler.waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in eng.scheduler.running):
        eng.step()
    for _ in range(8):  # steady state: every row decoding, the async pipeline full
        eng.step()
    for t in timers.values():
        t.take()
    walls, parts = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t0)
        parts.append(dict(eng.last_step))
    row = {
        "mode": mode, "fill": opts.get("fill", "serial"), "apply": opts.get("apply", "engine"),
        "running": n, "context": args.prompt_len,
        "step_wall_ms": ms(walls), "step_wall_mean_ms": round(1e3 * statistics.fmean(walls), 3),
        "schedule_ms": ms(p["schedule_s"] for p in parts),
        "launch_ms": ms(p["launch_s"] for p in parts),
        "complete_ms": ms(p["complete_s"] for p in parts),
    }  # fmt: skip
    for name, t in timers.items():
        row[name + "_ms"] = ms(t.take())
    row["rejected"] = eng.structured.num_rejected
    return row


def sync_debug(eng, steps: int) -> list[dict]:
    """The calls that synchronized the device during `steps` engine steps, with their stacks."""
    import torch

    found: dict[str, dict] = {}

    def hook(message, category, filename, lineno, file=None, line=None):
        stack = "".join(traceback.format_stack(limit=14)[:-2])
        entry = found.setdefault(stack, {"message": str(message), "count": 0, "stack": stack})
        entry["count"] += 1

    old = warnings.showwarning
    warnings.showwarning = hook
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        for _ in range(steps):
            eng.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old
    return sorted(found.values(), key=lambda e: -e["count"])


def trace(eng, steps: int, out: Path) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    out.mkdir(parents=True, exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=50, max_name_column_width=80)
    (out / "structured_cpu.txt").write_text(table)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=80)
    (out / "structured_cuda.txt").write_text(table)
    prof.export_chrome_trace(str(out / "structured_trace.json"))


def main() -> None:
    from atomc import LLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--root", default="/tmp/atomc-bench-models")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--schema", default=str(HERE / "structured_schema.json"))
    ap.add_argument(
        "--modes",
        default="plain,schema",
        help="comma-separated: plain, schema, or schema:fill=serial|batch|batchN+apply=engine|torch (A/B variants)",
    )
    ap.add_argument("--sync-debug", action="store_true")
    ap.add_argument("--trace", default=None, help="folder for a profiler table and trace of constrained steps")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    schema = json.loads(Path(args.schema).read_text())
    model_dir = str(make_checkpoint(args.model, Path(args.root), tiny=args.tiny))
    llm = LLM(
        model=model_dir,
        dtype="bfloat16" if args.device == "cuda" else "float32",
        device=args.device,
        load_format="dummy",
        max_model_len=args.prompt_len + args.steps + 256,
        max_num_seqs=args.num_seqs,
        max_num_batched_tokens=8192,
    )
    eng = llm.engine
    timers = {"finish_sampling": Timed(eng.structured, "finish_sampling"), "accept": Timed(eng.structured, "accept")}
    rows = []
    for k, mode in enumerate(args.modes.split(",")):
        row = run_mode(eng, mode, f"m{k}", args, schema, timers)
        if row.get("accept_ms") is not None:
            row["accept_per_step_ms"] = round(row["accept_ms"] * args.num_seqs, 3)
        first_schema = mode.startswith("schema") and not any(r["mode"] == "schema" for r in rows)
        if first_schema and args.sync_debug and args.device == "cuda":
            row["syncs"] = sync_debug(eng, 4)
        if first_schema and args.trace:
            trace(eng, 6, Path(args.trace))
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "syncs"}), flush=True)
        for i in range(args.num_seqs):
            eng.abort_request(f"m{k}-{i}")
        for _ in range(3):
            eng.step()
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
