"""The engine over two pipeline stages (this process stage 0 and the driver, one spawned stage
worker, gloo on CPU, fp32) gives the greedy tokens of one process, eager and compiled (each stage
its own artifact), with async scheduling keeping two micro-batches of different sequences in
flight; each stage holds the KV cache of its own layers; a stage that dies ends the engine with a
clear error in seconds."""

from __future__ import annotations

import re

import pytest

from atomc import LLM, SamplingParams
from atomc.config import SchedulerConfig
from atomc.engine.block_manager import BlockManager
from atomc.engine.scheduler import Scheduler
from atomc.engine.sequence import Sequence
from tests.engine.helpers import assert_killed_worker_ends_the_engine

# more prompts than one micro-batch holds: two steps of different sequences go in flight at once
PROMPTS = ["The capital of France is", "def add(a, b):\n", "1 2 3", "Once upon a time", "x = [", "Hello"]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
SMALL = dict(device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=64, max_num_seqs=8, enforce_eager=True)


def _tokens(path, params=GREEDY, **kw) -> list[list[int]]:
    with LLM(model=str(path), **SMALL, **kw) as llm:
        return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]


def _watch_launches(llm: LLM) -> list[tuple[list[int], list[list[int]]]]:
    """Per launch: its sequences, and the sequences of each step still in flight at that moment."""
    engine, seen = llm.engine, []
    launch = engine.runner.launch

    def watched(step):
        seen.append((step.seq_ids, [[s.seq_id for s in item.samplers] for item in engine._launched]))
        return launch(step)

    engine.runner.launch = watched
    return seen


def test_two_stages_generate_the_tokens_of_one(checkpoints):
    path = checkpoints["llama"]
    want = _tokens(path)
    with LLM(model=str(path), **SMALL, pipeline_parallel_size=2) as llm:
        assert llm.config.scheduler.async_scheduling
        runner = llm.engine.runner
        # stage 0 holds layer 0 of the two and its KV pages only; the LM head is the last stage's
        assert runner.kv_caches[0] is not None and runner.kv_caches[1] is None
        assert runner.model.lm_head is None
        seen = _watch_launches(llm)
        got = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]
        assert llm.engine.stats()["num_free_blocks"] == llm.engine.stats()["num_total_blocks"]
    assert got == want
    assert all(len(t) == 32 for t in got)
    overlapped = [(ids, flying) for ids, flying in seen if flying]
    assert len(overlapped) > len(seen) // 2  # steps launched while another was in flight
    for ids, flying in overlapped:  # a sequence is never in two steps in flight
        assert not set(ids) & {s for step in flying for s in step}


def test_two_compiled_stages_generate_the_tokens_of_one(checkpoints, tmp_path):
    """Each stage compiles its own artifact at start-up (stage 1's traced from hidden states, not
    ids), one cache entry per stage, keyed by it. (A start that loads them: the compile test below.)"""
    from atomc.graphs.cache_store import CacheStore

    path = checkpoints["llama"]
    want = _tokens(path)
    compiled = {**SMALL, "enforce_eager": False, "cache_dir": str(tmp_path), "pipeline_parallel_size": 2}
    with LLM(model=str(path), **compiled) as llm:
        assert llm.config.scheduler.async_scheduling
        assert llm.engine.runner.compile_info["hit"] is False
        store = CacheStore(llm.config.cache_path)
        got = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]
    assert got == want
    entries = store.entries(ready_only=True)
    stages = sorted((e.manifest()["factors"]["pp_stage"], e.manifest()["input_kind"]) for e in entries)
    assert stages == [(0, "ids"), (1, "hidden")]
    assert {e.manifest()["factors"]["pp_size"] for e in entries} == {2}


def test_compile_builds_each_stages_artifact_that_serve_then_loads(checkpoints, tmp_path):
    """`atomc compile -pp 2`: two processes build stage 0's and stage 1's entries (keyed by stage);
    a second start, an engine that may not compile (require_artifacts: a stage that missed would
    fail), loads them and decodes the tokens of one process."""
    import json

    from typer.testing import CliRunner

    from atomc.cli.main import app

    args = ["compile", "--model", str(checkpoints["llama"]), "--device", "cpu", "--dtype", "float32",
            "--cache-dir", str(tmp_path), "--pipeline-parallel-size", "2", "--max-num-seqs", "8", "--json"]  # fmt: skip
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    stages = json.loads(out.output[out.output.index("{") :])["ranks"]
    got = [(r["factors"]["pp_stage"], r["input_kind"], r["hit"]) for r in stages]
    assert got == [(0, "ids", False), (1, "hidden", False)]
    assert stages[0]["entry"] != stages[1]["entry"]
    compiled = {**SMALL, "enforce_eager": False, "cache_dir": str(tmp_path), "require_artifacts": True}
    with LLM(model=str(checkpoints["llama"]), **compiled, pipeline_parallel_size=2) as llm:
        assert llm.engine.runner.compile_info["hit"] is True
        assert llm.engine.runner.compile_info["entry"] == stages[0]["entry"]
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == _tokens(checkpoints["llama"])


def test_preemption_with_steps_in_flight_gives_the_tokens_of_one(checkpoints):
    """A pool too small for every sequence: the newest are preempted (their token may be in flight
    in the other micro-batch) and recomputed, and the next step reuses the blocks they freed while
    the stages still run the steps before it."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    tight = {**SMALL, "max_model_len": 64, "num_kv_blocks": 20, "block_size": 4, "max_num_seqs": 6}

    def run(**kw):
        with LLM(model=str(checkpoints["llama"]), **tight, **kw) as llm:
            out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
            stats = llm.engine.stats()
        assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
        return out

    assert run(pipeline_parallel_size=2) == run()


@pytest.mark.slow  # three stages: a middle one receives and sends; three micro-batches in flight
def test_three_stages_generate_the_tokens_of_one(tmp_path):
    from tests.conftest import build_checkpoint

    path = build_checkpoint("llama", tmp_path / "llama4", num_layers=4)  # layers 0-1, 2, 3
    want = _tokens(path)
    with LLM(model=str(path), **SMALL, pipeline_parallel_size=3) as llm:
        seen = _watch_launches(llm)
        got = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]
    assert got == want
    assert max(len(flying) for _, flying in seen) == 2


@pytest.mark.slow  # sampling, seeds and prompt logprobs go through the driver's deferred sampling
def test_two_stages_sample_and_score_prompts_as_one(checkpoints):
    path = checkpoints["qwen3"]  # its LM head is tied to the embedding: the last stage holds the table too
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12, prompt_logprobs=2, logprobs=1)

    def run(**kw):
        with LLM(model=str(path), **SMALL, **kw) as llm:
            outs = llm.generate(PROMPTS, params)
        rounded = [[{t: round(v, 3) for t, v in d.items()} for d in o.prompt_logprobs[1:]] for o in outs]
        return [o.outputs[0].token_ids for o in outs], rounded

    assert run(pipeline_parallel_size=2) == run()


@pytest.mark.slow  # structured outputs: the driver masks the rows once the last stage's logits are back
def test_two_stages_constrain_rows_as_one(checkpoints):
    from atomc.sampling_params import StructuredOutputsParams

    path = checkpoints["llama"]
    regex = SamplingParams(
        temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=r"[a-c]{2}-\d{2}")
    )
    params = [regex, GREEDY, regex, GREEDY, GREEDY, regex]

    def run(**kw):
        with LLM(model=str(path), **SMALL, **kw) as llm:
            return [(o.outputs[0].token_ids, o.outputs[0].text) for o in llm.generate(PROMPTS, params)]

    got = run(pipeline_parallel_size=2)
    assert got == run()
    assert all(re.fullmatch(r"[a-c]{2}-\d{2}", got[i][1]) for i in (0, 2, 5))


@pytest.mark.slow  # the async-scheduling twin: one step in flight at a time, stages sequential
def test_two_stages_without_async_scheduling(checkpoints):
    path = checkpoints["llama"]
    assert _tokens(path, pipeline_parallel_size=2, async_scheduling=False) == _tokens(path)


def test_a_killed_stage_ends_the_engine_with_a_clear_error(checkpoints):
    llm = LLM(model=str(checkpoints["llama"]), **SMALL, pipeline_parallel_size=2)
    match = "pipeline-stage worker rank 1 was killed by signal SIGKILL"
    assert_killed_worker_ends_the_engine(llm, llm.engine.executor.procs[0], match)


@pytest.mark.slow  # two processes start to find it out
def test_stages_with_different_kinds_of_attention_are_refused(checkpoints, tmp_path):
    import json
    import shutil

    path = tmp_path / "gpt_oss"
    shutil.copytree(checkpoints["gpt_oss"], path)
    config = json.loads((path / "config.json").read_text())
    n = config["num_hidden_layers"]
    # stage 0 only sliding-window layers, stage 1 only full ones: their block pools cannot line up
    config["layer_types"] = ["sliding_attention"] * (n // 2) + ["full_attention"] * (n - n // 2)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="pipeline stages hold different kinds of attention layers"):
        LLM(model=str(path), **SMALL, pipeline_parallel_size=2)


def test_micro_batches_split_the_sequences_and_skip_those_in_flight():
    params = SamplingParams(temperature=0, max_tokens=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256), BlockManager(64, 4), 2)
    seqs = [Sequence(i, f"r{i}", 0, [1, 2, 3], 3, params) for i in range(5)]
    for seq in seqs:
        sched.add(seq)
    first = sched.schedule()
    assert [item.seq.seq_id for item in first] == [0, 1, 2]  # ceil(5 / 2)
    sched.commit_computed(first)
    for item in first:  # their sampled tokens are in flight
        item.seq.num_pending = 1
    second = sched.schedule()
    assert [item.seq.seq_id for item in second] == [3, 4]
    sched.commit_computed(second)
    for item in second:
        item.seq.num_pending = 1
    assert sched.schedule() == []  # every sequence waits for its token
    for item in first:  # the first step is read back
        item.seq.num_pending = 0
        item.seq.token_ids.append(7)
    assert [item.seq.seq_id for item in sched.schedule()] == [0, 1, 2]
