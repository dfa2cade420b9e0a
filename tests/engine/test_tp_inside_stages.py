"""Tensor parallelism inside pipeline stages: `-tp 2 -pp 2` runs four processes (world rank = stage
* 2 + tensor-parallel rank; this process is stage 0's rank 0, the driver), each stage's two ranks
all-reducing over their own "tp" group, and gives the greedy tokens of one process (gloo on CPU,
fp32); each (stage, tp rank) compiles its own artifact; a stage-1 rank that dies ends the engine
with a clear error."""

from __future__ import annotations

import pytest

from atomc import LLM, SamplingParams
from atomc.config import EngineConfig
from atomc.graphs.cache_key import parallel_factors
from atomc.runtime import distributed
from models.layers.parallel import ParallelInfo
from tests.engine.helpers import assert_killed_worker_ends_the_engine

PROMPTS = ["The capital of France is", "def add(a, b):\n", "1 2 3", "Once upon a time"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SMALL = dict(device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=32, max_num_seqs=4, enforce_eager=True)
TP_PP = dict(tensor_parallel_size=2, pipeline_parallel_size=2)


def _tokens(path, **kw) -> list[list[int]]:
    with LLM(model=str(path), **{**SMALL, **kw}) as llm:
        return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]


def test_world_rank_layout_is_stage_major():
    """Rank = stage * T + tp rank: a stage's ranks are neighbours (one node's under torchrun)."""
    places = [ParallelInfo.of_world_rank(r, 2, 3) for r in range(6)]
    assert [(p.stage, p.rank) for p in places] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(p.world_rank(p.stage) == r for r, p in enumerate(places))
    assert places[3].world_rank(2) == 5 and places[3].world_rank(0) == 1  # the same shard's peers
    keys = set()
    for rank in range(4):
        par = EngineConfig().update(**TP_PP).parallel
        par.rank = rank
        keys.add(tuple(parallel_factors(par).items()))
        assert distributed.parallel_info(par) == ParallelInfo.of_world_rank(rank, 2, 2)
    assert len(keys) == 4  # each (stage, tp rank) its own artifact


@pytest.mark.slow  # the eager twin: the compiled run below is the default one
def test_tp_inside_two_stages_generates_the_tokens_of_one(checkpoints):
    path = checkpoints["llama"]
    want = _tokens(path)
    with LLM(model=str(path), **SMALL, **TP_PP) as llm:
        runner = llm.engine.runner
        assert (runner.parallel.stage, runner.parallel.rank, runner.parallel.size) == (0, 0, 2)
        assert runner.kv_caches[0] is not None and runner.kv_caches[1] is None  # stage 0: layer 0
        assert len(llm.engine.executor.procs) == 3
        got = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]
    assert got == want
    assert all(len(t) == 16 for t in got)


def test_compiled_tp_inside_two_stages_generates_the_tokens_of_one(checkpoints, tmp_path):
    from atomc.graphs.cache_store import CacheStore

    path = checkpoints["llama"]
    want = _tokens(path)
    compiled = {**SMALL, **TP_PP, "enforce_eager": False, "cache_dir": str(tmp_path)}
    with LLM(model=str(path), **compiled) as llm:
        runner = llm.engine.runner
        assert (runner.parallel.stage, runner.parallel.rank, runner.parallel.size) == (0, 0, 2)
        assert runner.kv_caches[0] is not None and runner.kv_caches[1] is None  # stage 0: layer 0
        assert runner.compile_info["hit"] is False
        store = CacheStore(llm.config.cache_path)
        got = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]
    assert got == want
    entries = store.entries(ready_only=True)
    places = sorted(
        (e.manifest()["factors"]["pp_stage"], e.manifest()["factors"]["tp_rank"], e.manifest()["input_kind"])
        for e in entries
    )
    assert places == [(0, 0, "ids"), (0, 1, "ids"), (1, 0, "hidden"), (1, 1, "hidden")]


def test_a_killed_stage_one_rank_ends_the_engine_with_a_clear_error(checkpoints):
    llm = LLM(model=str(checkpoints["llama"]), **SMALL, **TP_PP)
    proc = llm.engine.executor.procs[2]  # world rank 3: stage 1, tensor-parallel rank 1
    match = r"pipeline-stage worker rank 3 \(stage 1, tensor-parallel rank 1\) was killed by signal SIGKILL"
    assert_killed_worker_ends_the_engine(llm, proc, match, max_tokens=60, within_s=20)


@pytest.mark.slow  # four processes again; the Llama run covers the stages' groups by default
def test_experts_split_over_each_stages_ranks_give_the_tokens_of_one(checkpoints):
    """--enable-expert-parallel beside stages: a stage's MoE layers give each of its tensor-parallel
    ranks whole experts, their all-reduce on the stage's "tp" group."""
    from models.layers.moe import FusedMoE

    path = checkpoints["qwen3_moe"]
    want = _tokens(path)
    with LLM(model=str(path), **SMALL, **TP_PP, enable_expert_parallel=True) as llm:
        moe = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE)]
        assert moe and all(m.num_local_experts * 2 == m.num_experts and m.ep.size == 2 for m in moe)
        got = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]
    assert got == want


@pytest.mark.slow  # four compile processes, then four that load
def test_compile_builds_every_stage_and_rank_that_serve_then_loads(checkpoints, tmp_path):
    """`atomc compile -tp 2 -pp 2`: four processes build the four (stage, tp rank) entries; an engine
    that may not compile (require_artifacts) loads them and decodes the tokens of one process."""
    import json

    from typer.testing import CliRunner

    from atomc.cli.main import app

    path = checkpoints["llama"]
    args = ["compile", "--model", str(path), "--device", "cpu", "--dtype", "float32", "--cache-dir", str(tmp_path),
            "-tp", "2", "-pp", "2", "--max-num-seqs", "4", "--max-model-len", "64", "--json"]  # fmt: skip
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    ranks = json.loads(out.output[out.output.index("{") :])["ranks"]
    got = [(r["rank"], r["factors"]["pp_stage"], r["factors"]["tp_rank"], r["input_kind"], r["hit"]) for r in ranks]
    assert got == [(0, 0, 0, "ids", False), (1, 0, 1, "ids", False), (2, 1, 0, "hidden", False),
                   (3, 1, 1, "hidden", False)]  # fmt: skip
    assert len({r["entry"] for r in ranks}) == 4
    strict = {**SMALL, **TP_PP, "enforce_eager": False, "cache_dir": str(tmp_path), "require_artifacts": True}
    with LLM(model=str(path), **strict) as llm:
        assert llm.engine.runner.compile_info["entry"] == ranks[0]["entry"]
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == _tokens(path)


@pytest.mark.slow  # seeded sampling and prompt logprobs from the last stage's gathered logits
def test_tp_inside_stages_samples_and_scores_prompts_as_one(checkpoints):
    path = checkpoints["qwen3"]  # tied head: the last stage holds a vocab-parallel shard of the table
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=8, prompt_logprobs=2, logprobs=1)

    def run(**kw):
        with LLM(model=str(path), **{**SMALL, **kw}) as llm:
            outs = llm.generate(PROMPTS, params)
        rounded = [[{t: round(v, 3) for t, v in d.items()} for d in o.prompt_logprobs[1:]] for o in outs]
        return [o.outputs[0].token_ids for o in outs], rounded

    assert run(**TP_PP) == run()
