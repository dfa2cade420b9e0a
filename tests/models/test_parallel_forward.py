"""A model split over two ranks computes what one process computes: each rank loads its shard of the
same tiny checkpoint, the layers' collectives (atomc::all_reduce / all_gather) run over gloo, and
the logits match the single-process model's (fp32) to round-off, with the same greedy tokens.

Tensor parallelism splits heads, MLP features and the vocabulary; expert parallelism gives each rank
half of the experts whole (attention and dense layers stay tensor-parallel); pipeline parallelism
gives each rank a run of layers, the first stage sending its hidden states to the second."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from atomc.ops import collective
from models.layers.parallel import ParallelInfo
from models.loader import load_model

PROMPT = [5, 17, 101, 3, 250, 42, 7, 99, 311, 64]


def _logits(path, parallel: ParallelInfo) -> torch.Tensor:
    model = load_model(path, torch.float32, "cpu", parallel=parallel)
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(len(PROMPT))))


def _rank(rank: int, size: int, init: str, path, expert_parallel: bool, out, fuse_shared: bool | None = None) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        if fuse_shared is not None:  # a spawned rank imports the module afresh: the switch as the test sets it
            from models import deepseek

            deepseek.FUSE_SHARED_EXPERTS = fuse_shared
        collective.set_group("tp", None)
        logits = _logits(path, ParallelInfo(rank, size, expert_parallel=expert_parallel))
        torch.save(logits, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _stage(rank: int, size: int, init: str, path, out) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        parallel = ParallelInfo(stage=rank, stages=size)
        model = load_model(path, torch.float32, "cpu", parallel=parallel)
        ids, positions = torch.tensor(PROMPT), torch.arange(len(PROMPT))
        hidden = None
        with torch.no_grad():
            if not parallel.first_stage:
                hidden = torch.empty(len(PROMPT), model.config.hidden_size)
                dist.recv(hidden, src=rank - 1)
            hidden = model(ids, positions, hidden)
            if not parallel.last_stage:
                dist.send(hidden, dst=rank + 1)
            else:
                torch.save(model.compute_logits(hidden), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def run_split(
    path, tmp_path, size: int = 2, expert_parallel: bool = False, pipeline: bool = False,
    fuse_shared: bool | None = None,
) -> list:  # fmt: skip
    init = f"file://{tmp_path / 'rendezvous'}"
    out = tmp_path / "logits"
    if pipeline:
        mp.start_processes(_stage, args=(size, init, path, out), nprocs=size, start_method="spawn")
        return [torch.load(f"{out}.{size - 1}")]
    args = (size, init, path, expert_parallel, out, fuse_shared)
    mp.start_processes(_rank, args=args, nprocs=size, start_method="spawn")
    return [torch.load(f"{out}.{r}") for r in range(size)]


@pytest.mark.parametrize(
    "family, expert_parallel",
    [("llama", False), pytest.param("qwen3", False, marks=pytest.mark.slow),
     pytest.param("qwen3_moe", False, marks=pytest.mark.slow), ("qwen3_moe", True), ("deepseek_v3", True)],
)  # fmt: skip
def test_two_ranks_match_one_process(checkpoints, tmp_path, family, expert_parallel):
    whole = _logits(checkpoints[family], ParallelInfo())
    ranks = run_split(checkpoints[family], tmp_path, expert_parallel=expert_parallel)
    for logits in ranks:  # every rank holds the gathered logits
        assert logits.shape == whole.shape
        torch.testing.assert_close(logits, whole, atol=1e-4, rtol=1e-4)
        assert torch.equal(logits.argmax(-1), whole.argmax(-1))


def test_shared_experts_inside_the_op_split_over_two_ranks(checkpoints, tmp_path, monkeypatch):
    """DeepSeek-V2 (two shared experts) tensor-parallel with its shared experts inside the MoE op
    (models/deepseek.py FUSE_SHARED_EXPERTS): each rank a slice of every expert's intermediate size,
    shared ones included; the ranks match the single process without the fusion."""
    from models import deepseek

    monkeypatch.setattr(deepseek, "FUSE_SHARED_EXPERTS", False)
    whole = _logits(checkpoints["deepseek_v2"], ParallelInfo())
    for logits in run_split(checkpoints["deepseek_v2"], tmp_path, fuse_shared=True):
        torch.testing.assert_close(logits, whole, atol=1e-4, rtol=1e-4)
        assert torch.equal(logits.argmax(-1), whole.argmax(-1))


@pytest.mark.parametrize("family", ["llama", "qwen3", pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def test_two_pipeline_stages_match_one_process(checkpoints, tmp_path, family):
    """qwen3's head is tied to its embedding: the last stage holds the table too."""
    whole = _logits(checkpoints[family], ParallelInfo())
    (last,) = run_split(checkpoints[family], tmp_path, pipeline=True)
    torch.testing.assert_close(last, whole, atol=1e-4, rtol=1e-4)
    assert torch.equal(last.argmax(-1), whole.argmax(-1))


def test_a_stage_holds_only_its_layers(checkpoints):
    from models.decoder import OtherStageLayer

    first = load_model(checkpoints["llama"], torch.float32, "cpu", parallel=ParallelInfo(stage=0, stages=2))
    last = load_model(checkpoints["llama"], torch.float32, "cpu", parallel=ParallelInfo(stage=1, stages=2))
    assert first.model.norm is None and first.lm_head is None and isinstance(first.model.layers[1], OtherStageLayer)
    assert last.model.embed_tokens is None and isinstance(last.model.layers[0], OtherStageLayer)
    assert not list(last.model.layers[0].parameters())
    with pytest.raises(ValueError, match="only the last pipeline stage"):
        first.compute_logits(torch.zeros(1, 64))
    # each stage's KV cache holds its own layers only; the layer ids stay the model's
    first_specs, last_specs = first.kv_cache_specs(), last.kv_cache_specs()
    assert first_specs[0] is not None and first_specs[1] is None
    assert last_specs[0] is None and last_specs[1] == first_specs[0]
    assert [ParallelInfo(stage=s, stages=3).stage_layers(8) for s in range(3)] == [
        range(0, 3),
        range(3, 6),
        range(6, 8),
    ]
    with pytest.raises(ValueError, match="cannot fill 3 pipeline stages"):
        ParallelInfo(stage=0, stages=3).stage_layers(2)


def test_the_collectives_outside_a_worker_are_a_clear_error():
    with pytest.raises(RuntimeError, match="not set up in this process"):
        torch.ops.atomc.all_reduce(torch.ones(2), "tp")
