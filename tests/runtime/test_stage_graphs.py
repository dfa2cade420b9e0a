"""A pipeline stage's CUDA-graph paths (runtime/stage_graphs.py), run without capture on the CPU:
the hidden states a stage after the first receives go into the graphs' static input, and the
padded decode and mixed batches give the hidden states of the stage's plain forward."""

from __future__ import annotations

import pytest
import torch

from atomc.forward_context import group_context, set_forward_context
from atomc.kernels.registry import ensure_registered, kv_cache_layout
from atomc.runtime.batch import StepInput, prefill_step_input, slots_for
from atomc.runtime.kv_cache import allocate_kv_cache
from atomc.runtime.model_runner import device_batch
from atomc.runtime.stage_graphs import StageGraphs
from models.layers.parallel import ParallelInfo
from models.loader import load_model

BLOCK = 4
LENS = [5, 3]  # two prompts; decode batches of 2 pad up to the graph of 4
TABLES = [[0, 1], [2, 3]]  # the prefill's blocks (prefill_step_input: [0, 1], [2]), then block 3


def _decode_step(step_id: int, context: list[int]) -> StepInput:
    slots = [s for n, table in zip(context, TABLES, strict=True) for s in slots_for(table, n, n + 1, BLOCK)]
    return StepInput(step_id, [0, 1], [1, 1], context, TABLES, [7, 8], context, slots, [], [], [])


def _run_eager(model, caches, step: StepInput, hidden: torch.Tensor | None) -> torch.Tensor:
    ids, positions, metas = device_batch(step, "cpu")
    with set_forward_context(group_context(metas, caches, [0] * len(caches), None)):
        return model(ids, positions, hidden)


@pytest.mark.parametrize("stage", [0, 1])
def test_stage_graphs_give_the_hidden_states_of_the_forward(llama_dir, stage):
    ensure_registered("cpu")
    model = load_model(llama_dir, torch.float32, "cpu", parallel=ParallelInfo(stage=stage, stages=2))
    hidden_size = model.config.hidden_size

    def caches():
        specs = model.kv_cache_specs()
        return allocate_kv_cache(specs, 8, BLOCK, torch.float32, "cpu", lambda s: kv_cache_layout("cpu", s))

    eager_caches, graph_caches = caches(), caches()
    hidden = None if stage == 0 else (hidden_size, torch.float32)
    graphs = StageGraphs(model.forward, graph_caches, [4], [16], 4, 4, 32, "cpu", hidden, capture=False)
    if stage:  # rows past each step's must not matter (finite leftovers, as on a GPU)
        graphs.hidden_in.fill_(1e3)
    gen = torch.Generator().manual_seed(0)
    prefill = prefill_step_input(LENS, BLOCK)
    steps = [prefill] + [_decode_step(i, [n + i - 1 for n in LENS]) for i in (1, 2, 3)]
    for step in steps:
        received = torch.randn(step.num_tokens, hidden_size, generator=gen) if stage else None
        want = _run_eager(model, eager_caches, step, received)
        replay = graphs.replayer(step)
        assert replay is not None
        if stage:
            graphs.hidden_rows(step.num_tokens).copy_(received)
        got = replay(None)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert graphs.decode.key_for(2, 1) == (4, 1) and graphs.mixed.padded_size(sum(LENS)) == 16
