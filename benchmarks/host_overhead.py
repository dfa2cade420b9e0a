"""Host time per decode step at 64 and 256 running requests (8B shape, bf16, decode CUDA graphs),
and whether launches keep the GPU busy on mixed steps (prefill chunk + decodes) outside graphs.

Host time = step wall time - GPU time of the same step, where the GPU time is the replay of the
captured graph of that size, timed alone with CUDA events. Each size is stepped first with async
scheduling off (host time, and its schedule / launch / complete split) and then on
(`async_step_wall_ms`: what is left of a step once its host work overlaps the previous step's GPU work).

Mixed steps: `launch_ms` is the CPU time to enqueue one compiled forward without a graph; `gpu_ms`
the time per forward over 10 back-to-back forwards (the CPU runs ahead, so this is the larger of GPU
and launch time); `graph_wall_ms` the wall time of the same step replayed from its mixed-batch CUDA
graph (staging copies, one launch, sync), for steps within the captured sizes.

    python benchmarks/host_overhead.py --out host.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoints import make_checkpoint  # noqa: E402


def main() -> None:
    import torch

    from atomc import LLM, SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--root", default="/tmp/atomc-bench-models")
    ap.add_argument("--sizes", default="1,64,256")
    ap.add_argument("--mixed-prompts", default="128,1024,8000", help="prefill chunk sizes next to 64 decodes")
    ap.add_argument("--prompt-len", type=int, default=32, help="context of the decoding requests")
    ap.add_argument("--profile-out", default=None, help="kernel time table of the 64-request decode graph")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    model_dir = str(make_checkpoint(args.model, Path(args.root)))
    llm = LLM(
        model=model_dir,
        dtype="bfloat16",
        device="cuda",
        load_format="dummy",
        max_model_len=8192,
        max_num_seqs=max(sizes),
        max_num_batched_tokens=8192,
    )
    eng = llm.engine
    rows = []
    for n in sizes:
        for i in range(n):
            eng.add_request(
                f"{n}-{i}",
                list(range(100 + i, 100 + i + args.prompt_len)),
                SamplingParams(temperature=0, max_tokens=80, ignore_eos=True),
            )
        while any(s.num_computed_tokens < s.num_tokens - 1 for s in eng.scheduler.running) or eng.scheduler.waiting:
            eng.step()
        walls = {}
        for overlap in (False, True):  # the engine reads the flag each step
            eng.config.scheduler.async_scheduling = overlap
            eng.step()
            walls[overlap], parts = [], []
            for _ in range(30):
                t0 = time.perf_counter()
                eng.step()
                walls[overlap].append(time.perf_counter() - t0)
                parts.append(dict(eng.last_step))
            if not overlap:
                sync_parts = parts
        graphs = eng.runner.decode_graphs
        size = graphs.key_for(n, 1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graphs.graphs[size].replay()
        end.record()
        torch.cuda.synchronize()
        gpu = start.elapsed_time(end) / 20 / 1e3
        wall = statistics.median(walls[False])
        # sync: host time = wall - graph; async: the step wall left once host work overlaps the graph
        row = {
            "running": n, "step_wall_ms": 1e3 * wall, "graph_replay_ms": 1e3 * gpu,
            "host_ms": 1e3 * (wall - gpu),
            "schedule_ms": 1e3 * statistics.median(p["schedule_s"] for p in sync_parts),
            "launch_ms": 1e3 * statistics.median(p["launch_s"] for p in sync_parts),
            "complete_ms": 1e3 * statistics.median(p["complete_s"] for p in sync_parts),
            "async_step_wall_ms": 1e3 * statistics.median(walls[True]),
        }  # fmt: skip
        row["context"] = args.prompt_len
        rows.append(row)
        print(json.dumps(row), flush=True)
        if n == 64 and args.profile_out:
            profile_graph(graphs.graphs[size], Path(args.profile_out))
        if n == 64:
            for p in (int(x) for x in args.mixed_prompts.split(",") if x):
                row = mixed_step(eng, p)
                rows.append(row)
                print(json.dumps(row), flush=True)
        for i in range(n):
            eng.abort_request(f"{n}-{i}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


def profile_graph(graph, out: Path) -> None:
    """GPU time per kernel over 10 replays of one captured decode graph, as a table."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
    out.write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90))


def mixed_step(eng, prompt_len: int) -> dict:
    """Launch vs GPU time of the compiled forward on one step: the running decodes + a prompt chunk."""
    import torch

    from atomc import SamplingParams
    from atomc.engine.step_input import build_step_input
    from atomc.forward_context import ForwardContext, set_forward_context
    from atomc.runtime.model_runner import device_batch

    # one synchronous step reads every token back: the step built below has no pending input
    eng.config.scheduler.async_scheduling = False
    eng.step()
    eng.add_request("mixed", [10 + i % 300 for i in range(prompt_len)], SamplingParams(max_tokens=1))
    scheduled = eng.scheduler.schedule()
    runner = eng.runner
    step, _ = build_step_input(scheduled, runner.block_size, -1, None, [])
    ids, pos, (meta,) = device_batch(step, runner.device)  # a dense model: one KV group
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.inference_mode(), set_forward_context(ForwardContext(meta, runner.kv_caches)):
        runner.forward(ids, pos)
        torch.cuda.synchronize()
        launches = []
        for _ in range(5):
            t0 = time.perf_counter()
            runner.forward(ids, pos)
            launches.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
        start.record()
        for _ in range(10):
            runner.forward(ids, pos)
        end.record()
        torch.cuda.synchronize()
    row = {
        "mixed_tokens": int(ids.shape[0]), "decodes": sum(1 for s in scheduled if s.num_new_tokens == 1),
        "prefill_chunk": max(s.num_new_tokens for s in scheduled),
        "launch_ms": 1e3 * statistics.median(launches), "gpu_ms": start.elapsed_time(end) / 10,
    }  # fmt: skip
    graphs = runner.mixed_graphs
    if graphs is not None and graphs.fits(row["mixed_tokens"], len(scheduled)):
        # the same forward replayed from its mixed-batch CUDA graph: staging copies + one launch + sync
        walls = []
        for _ in range(5):
            t0 = time.perf_counter()
            graphs.replay(step)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
        row["graph_wall_ms"] = 1e3 * statistics.median(walls)
    eng.abort_request("mixed")  # the scheduled chunk never commits; its blocks go back here
    return row


if __name__ == "__main__":
    main()
