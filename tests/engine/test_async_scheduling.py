"""Async scheduling: step N+1 is scheduled and launched before step N's tokens are read back, its
pending inputs fed on the device. Every case must give exactly the tokens of the synchronous engine,
free every block, and actually run ahead (a launched step left in flight)."""

from __future__ import annotations

import pytest
import torch

from atomc import LLM, SamplingParams
from atomc.config import SchedulerConfig
from atomc.engine.block_manager import BlockManager
from atomc.engine.scheduler import ScheduledSeq, Scheduler
from atomc.engine.sequence import Sequence
from atomc.engine.step_input import build_step_input
from tests.engine.helpers import PROMPTS, assert_pool_free, make


def outputs(llm: LLM, params) -> list[tuple]:
    """Tokens, text and finish of every sample, with logprobs rounded: the batches differ between
    the two engines (preemption timing), which moves fp32 logprobs in the last bits."""
    outs = llm.generate(PROMPTS, params)
    return [
        (c.token_ids, c.text, c.finish_reason, c.stop_reason,
         [{t: round(v, 3) for t, v in d.items()} for d in c.logprobs] if c.logprobs else None)
        for o in outs
        for c in o.outputs
    ]  # fmt: skip


def count_launches(llm: LLM) -> list[int]:
    """Records, per launch, how many sequences had an input still pending on the device."""
    runner, seen = llm.engine.runner, []
    launch = runner.launch

    def counted(step):
        seen.append(len(step.feed_rows))  # one pending input per sequence: one step of lookahead
        return launch(step)

    runner.launch = counted
    return seen


CASES = {
    "greedy": dict(temperature=0, max_tokens=24, ignore_eos=True),
    "stops": dict(temperature=0, max_tokens=30, stop=[" the", "e"], stop_token_ids=[262]),
    "seeded_n2_logprobs": dict(temperature=0.8, top_k=20, top_p=0.9, seed=7, n=2, max_tokens=16, logprobs=3),
    "penalties": dict(temperature=0, max_tokens=16, repetition_penalty=1.3, frequency_penalty=0.5),
    "min_tokens": dict(temperature=0, max_tokens=12, min_tokens=6),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("engine", ["chunked", "preempting"])
def test_async_gives_the_synchronous_tokens(llama_dir, case, engine):
    params = SamplingParams(**CASES[case])
    # chunked: a 7-token budget splits prompts into chunks that share steps with decodes;
    # preempting: 8 blocks of 16 slots for 5 sequences force preemption and recompute
    kw = dict(max_num_batched_tokens=7) if engine == "chunked" else dict(num_kv_blocks=8, max_model_len=128)
    expected = outputs(make(llama_dir, async_scheduling=False, **kw), params)
    llm = make(llama_dir, async_scheduling=True, **kw)
    pending = count_launches(llm)
    assert outputs(llm, params) == expected
    assert_pool_free(llm)
    if case in ("penalties", "min_tokens"):
        assert not any(pending)  # their sampling reads the history: each step waits for the last
    else:
        assert any(pending)  # steps were launched with inputs still on the device
    if engine == "preempting" and case == "greedy":  # the others stop too soon to run out of blocks
        assert llm.engine.scheduler.num_preemptions > 0


def test_max_tokens_costs_no_extra_step_and_a_stop_costs_one(llama_dir):
    llm = make(llama_dir, async_scheduling=True)
    launches = count_launches(llm)
    llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(launches) == 5  # prefill + 4 decodes: the 5th token's length limit is known ahead
    launches.clear()
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, stop=["e"]))[0].outputs[0]
    assert out.finish_reason == "stop"
    # the step after the stopping token was already launched when the stop was seen: one extra
    assert len(launches) == len(out.token_ids) + 1
    assert_pool_free(llm)


def test_abort_while_a_step_is_in_flight(llama_dir):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = make(llama_dir, async_scheduling=False).generate(PROMPTS[1], params)[0].outputs[0].token_ids
    llm = make(llama_dir, async_scheduling=True)
    eng = llm.engine
    eng.add_request("keep", PROMPTS[1], params)
    eng.add_request("drop", PROMPTS[3], params)
    for _ in range(4):
        eng.step()
    assert eng._in_flight is not None and any(s.request_id == "drop" for s in eng._in_flight.samplers)
    assert eng.abort_request("drop").outputs[0].finish_reason == "abort"
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            assert out.request_id == "keep"  # nothing more is reported for the aborted request
            final = out
    assert final.finished and final.outputs[0].token_ids == ref
    assert_pool_free(llm)


def test_engine_used_again_after_a_stale_step(llama_dir):
    """A step still in flight when the last request finished is read back (and dropped) next time."""
    # every token is a stop token: each request ends at its first token, after its decode launched
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=list(range(512)))
    llm = make(llama_dir, async_scheduling=True)
    first = [c for o in llm.generate(PROMPTS, params) for c in o.outputs]
    assert llm.engine._in_flight is not None  # launched for sequences that then stopped
    again = [c for o in llm.generate(PROMPTS, params) for c in o.outputs]
    assert [c.token_ids for c in again] == [c.token_ids for c in first]
    assert all(len(c.token_ids) == 1 and c.finish_reason == "stop" for c in again)
    assert_pool_free(llm)


# --- scheduler and runner pieces -------------------------------------------------------------------


def seq(i: int, n_prompt: int, max_tokens: int = 100) -> Sequence:
    s = Sequence(i, str(i), 0, list(range(10, 10 + n_prompt)), n_prompt, SamplingParams(max_tokens=max_tokens))
    s.max_num_tokens = n_prompt + max_tokens
    return s


def test_scheduler_counts_pending_tokens():
    blocks = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), blocks)
    a, b = seq(0, 7), seq(1, 5, max_tokens=1)
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    assert [(x.seq.seq_id, x.num_new_tokens, x.samples) for x in step] == [(0, 7, True), (1, 5, True)]
    sched.commit_computed(step)
    a.num_pending = b.num_pending = 1  # both sampled, not read back
    # a's block 1 holds tokens 4..7: token 7 is pending, so only block 0 is hashed
    assert len(a.block_hashes) == 1
    step = sched.schedule()
    # a decodes its pending token; b's one allowed token is the pending one, so b is not scheduled
    assert [(x.seq.seq_id, x.num_new_tokens, x.samples) for x in step] == [(0, 1, True)]
    sched.commit_computed(step)
    a.num_pending += 1
    a.token_ids.append(99)  # the first pending token lands
    a.num_pending -= 1
    sched.commit_computed([ScheduledSeq(a, 0)])
    assert len(a.block_hashes) == 2  # tokens 4..7 are all known now


def test_preempted_sequence_waits_for_its_pending_token():
    blocks = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), blocks)
    a = seq(0, 6)
    sched.add(a)
    sched.commit_computed(sched.schedule())
    a.num_pending = 1
    sched.preempt(a)
    assert sched.schedule() == []  # its prompt cannot be recomputed before its token is known
    a.token_ids.append(50)
    a.num_pending = 0
    step = sched.schedule()
    assert [(x.seq.seq_id, x.num_new_tokens) for x in step] == [(0, 7 - 4)]  # block 0 from the cache


def test_runner_refuses_a_pending_input_it_cannot_feed(llama_dir):
    llm = make(llama_dir, async_scheduling=True)
    eng = llm.engine
    eng.add_request("x", PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))
    scheduled = eng.scheduler.schedule()
    eng.scheduler.commit_computed(scheduled)
    scheduled[0].seq.num_pending = 1  # pending, but no launch sampled it
    scheduled = eng.scheduler.schedule()
    with pytest.raises(RuntimeError, match="no launch in flight"):
        build_step_input(scheduled, eng.blocks.block_size, 0, None, [])
    step, _ = build_step_input(scheduled, eng.blocks.block_size, 1, 0, [])  # "from step 0", never launched
    with pytest.raises(RuntimeError, match="feeds inputs from step 0"):
        eng.runner.launch(step)


def test_pending_sample_reads_back_tokens_and_logprobs():
    from atomc.runtime.sampler import Sampler, SamplingBatch

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0), SamplingParams(temperature=0)]
    batch = SamplingBatch(params, [[]] * 3, [[]] * 3, [None] * 3)
    pending = Sampler().sample(logits, batch)
    assert torch.equal(pending.token_ids, logits.argmax(-1))  # still a tensor: the next step's inputs
    out = pending.result()
    assert out.token_ids == logits.argmax(-1).tolist()
    lp = torch.log_softmax(logits[0], -1)
    assert list(out.logprobs[0]) == lp.topk(2).indices.tolist()  # sampled (= top 1) first, then top 2
    assert out.logprobs[1] is None and out.logprobs[2] is None
