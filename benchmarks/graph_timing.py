"""Kernels timed as a model's CUDA graph runs them: one graph holding a call per argument tuple, back
to back (each tuple its own buffers, so the data comes from HBM as each layer's does in a model),
replayed; the time of one call is the replay's median over the number of calls. `save_results`
writes such a benchmark's rows with the device they ran on."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def graph_time_us(fn, calls: list[tuple], rep_ms: int = 40) -> float:
    """Median µs of one call, from replays of a graph holding `fn(*args)` for every args in `calls`."""
    from triton.testing import do_bench  # not at import: scripts set TRITON_INTERPRET before triton loads

    for args in calls:
        fn(*args)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in calls:
            fn(*args)
    return do_bench(graph.replay, warmup=5, rep=rep_ms, return_mode="median") * 1e3 / len(calls)


def save_results(out: str | None, results: list[dict], tiny: bool) -> None:
    """{"device", "results"} as JSON at `out` (nothing when None); "cpu" for a --tiny run."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        device = "cpu" if tiny else torch.cuda.get_device_name()
        Path(out).write_text(json.dumps({"device": device, "results": results}, indent=1))
