"""Kernels timed as a model's CUDA graph runs them: one graph holding a call per argument tuple, back
to back (each tuple its own buffers, so the data comes from HBM as each layer's does in a model),
replayed; the time of one call is the replay's median over the number of calls."""

from __future__ import annotations

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
