"""A step that raises fails only its own requests; the engine frees their blocks and keeps serving.

Only MAX_FAILED_STEPS failures in a row (a broken device) escape `step()`. Sampled ids outside the
vocabulary are caught before they become the next step's input.
"""

from __future__ import annotations

import re

import pytest

from atomc.engine.llm_engine import MAX_FAILED_STEPS
from atomc.runtime.batch import StepResult
from atomc.sampling_params import SamplingParams
from tests.engine.helpers import assert_pool_free, make


def run_all(engine, limit: int = 500) -> dict:
    done = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError("did not finish")


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_failed_step_fails_its_requests_and_the_engine_keeps_serving(llama_dir, monkeypatch, async_scheduling):
    llm = make(llama_dir, num_kv_blocks=64, async_scheduling=async_scheduling)
    engine = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0)
    engine.add_request("a", "The capital of France is", params)
    engine.add_request("b", "1 2 3", params)
    engine.step()  # both are in the batch now
    real_launch = engine.runner.launch
    calls = {"n": 0}

    def launch_once_broken(scheduled):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel failure")
        return real_launch(scheduled)

    monkeypatch.setattr(engine.runner, "launch", launch_once_broken)
    outs = engine.step()
    failed = {o.request_id: o for o in outs if o.error is not None}
    assert set(failed) == {"a", "b"} and all(o.finished for o in failed.values())
    assert "simulated kernel failure" in failed["a"].error
    assert not engine.has_unfinished_requests()
    assert_pool_free(llm)
    assert engine.stats()["num_failed_steps"] == 1
    # the engine serves the next requests as if nothing happened
    engine.add_request("c", "The capital of France is", params)
    done = run_all(engine)
    assert done["c"].error is None and len(done["c"].outputs[0].token_ids) == 6
    assert_pool_free(llm)


def test_waiting_requests_survive_a_failed_step(llama_dir, monkeypatch):
    llm = make(llama_dir, num_kv_blocks=64, max_num_seqs=1)  # one runs, the other waits
    engine = llm.engine
    params = SamplingParams(max_tokens=4, temperature=0)
    engine.add_request("running", "1 2 3", params)
    engine.add_request("waiting", "The capital of France is", params)
    engine.step()
    real_complete = engine._complete

    def complete_once_broken(launched):
        monkeypatch.setattr(engine, "_complete", real_complete)
        raise RuntimeError("simulated read-back failure")

    monkeypatch.setattr(engine, "_complete", complete_once_broken)
    outs = engine.step()
    assert [o.request_id for o in outs if o.error] == ["running"]
    done = run_all(engine)
    assert done["waiting"].error is None and len(done["waiting"].outputs[0].token_ids) == 4
    assert_pool_free(llm)


def test_repeated_failures_escape_step(llama_dir, monkeypatch):
    llm = make(llama_dir, num_kv_blocks=64)
    engine = llm.engine

    def broken(scheduled):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "launch", broken)
    for i in range(MAX_FAILED_STEPS - 1):
        engine.add_request(f"r{i}", "1 2 3", SamplingParams(max_tokens=3))
        assert [o.error is not None for o in engine.step()] == [True]
    engine.add_request("last", "1 2 3", SamplingParams(max_tokens=3))
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()


def test_sampled_id_outside_the_vocabulary_fails_the_step(llama_dir, monkeypatch):
    llm = make(llama_dir, num_kv_blocks=64, async_scheduling=False)
    engine = llm.engine
    vocab = engine.arch.vocab_size
    real_launch = engine.runner.launch

    class BadSample:
        def __init__(self, pending):
            self.pending = pending

        def result(self):
            good = self.pending.result()
            return StepResult([vocab + 5] * len(good.token_ids), good.logprobs)

    monkeypatch.setattr(engine.runner, "launch", lambda s: BadSample(real_launch(s)))
    engine.add_request("x", "1 2 3", SamplingParams(max_tokens=3))
    outs = engine.step()
    assert outs[0].error is not None and "outside the vocabulary" in outs[0].error
    assert_pool_free(llm)


def test_start_up_logs_each_phase_with_its_time(llama_dir, caplog):
    with caplog.at_level("INFO", logger="atomc.engine.llm_engine"):
        make(llama_dir, num_kv_blocks=64)
    phases = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up:")]
    assert len(phases) == 3, phases
    assert re.fullmatch(r"start-up: model folder \d+\.\ds, tokenizer \d+\.\ds \(llama\)", phases[0]), phases[0]
    assert phases[1].startswith("start-up: imports ") and "(backend ops, compiler), weights " in phases[1]
    assert "model (eager)" in phases[1] and "KV cache (64 blocks)" in phases[1]
    assert "engine ready in" in phases[2]
