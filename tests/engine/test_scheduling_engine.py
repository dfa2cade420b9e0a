"""Engine behaviour on a tiny llama: batching, prefix caching, chunked prefill, preemption, stops, n, seeds."""

from __future__ import annotations

import pytest
import torch

from atomc import LLM, SamplingParams
from tests.engine.helpers import PROMPTS, assert_pool_free, make

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return make(llama_dir)


@pytest.fixture(scope="module")
def one_at_a_time(llama_dir) -> list[list[int]]:
    solo = make(llama_dir, enable_prefix_caching=False)
    return [solo.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_mixed_length_batch_equals_one_at_a_time(llama_dir, one_at_a_time):
    llm = make(llama_dir, enable_prefix_caching=False)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == one_at_a_time
    assert_pool_free(llm)


def test_prefix_cache_hit_gives_same_tokens_and_reports_cached(llama_dir, one_at_a_time):
    llm = make(llama_dir)
    long = PROMPTS[3]
    first = llm.generate(long, GREEDY)[0]
    assert first.num_cached_tokens == 0
    second = llm.generate(long, GREEDY)[0]
    n_prompt = len(second.prompt_token_ids)
    # every full block but the one holding the last prompt token comes from the cache
    assert second.num_cached_tokens == ((n_prompt - 1) // 16) * 16 > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids == one_at_a_time[3]
    # a different suffix on the same prefix still hits the shared blocks
    third = llm.generate(long + " and more", GREEDY)[0]
    assert third.num_cached_tokens >= 16
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["prefix_cache_queries"] >= stats["prefix_cache_hits"]
    assert_pool_free(llm)


def test_chunked_prefill_with_small_budget_is_identical(llama_dir, one_at_a_time):
    llm = make(llama_dir, max_num_batched_tokens=7, enable_prefix_caching=False)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == one_at_a_time


def test_prefill_and_decode_share_a_step(llama_dir):
    llm = make(llama_dir)
    eng = llm.engine
    eng.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=8))
    eng.step()  # a's prefill; a now decodes
    eng.add_request("b", PROMPTS[1], SamplingParams(temperature=0, max_tokens=8))
    scheduled = eng.scheduler.schedule()
    kinds = {item.seq.request_id: item.num_new_tokens for item in scheduled}
    assert kinds["a"] == 1 and kinds["b"] > 1  # one decode token and a prefill in the same batch
    for item in scheduled:  # undo the dry schedule: release the blocks it took
        eng.scheduler.preempt(item.seq)
    while eng.has_unfinished_requests():
        eng.step()
    assert_pool_free(llm)


def test_small_kv_pool_forces_preemption_and_keeps_tokens(llama_dir, one_at_a_time):
    # 8 blocks of 16 = 128 token slots for 5 sequences of up to ~90 tokens each
    llm = make(llama_dir, num_kv_blocks=8, max_model_len=128, enable_prefix_caching=False)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == one_at_a_time
    assert llm.engine.scheduler.num_preemptions > 0
    assert_pool_free(llm)


def test_preemption_with_prefix_cache_is_identical(llama_dir, one_at_a_time):
    llm = make(llama_dir, num_kv_blocks=8, max_model_len=128)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == one_at_a_time
    assert_pool_free(llm)


def test_seeded_sampling_reproduces_and_n_gives_distinct_samples(llm):
    p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=1234, n=3, ignore_eos=True)
    a = llm.generate(PROMPTS[0], p)[0]
    b = llm.generate([PROMPTS[0], PROMPTS[1]], p)[0]  # other requests in the batch change nothing
    assert len(a.outputs) == 3
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1
    c = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=16, seed=99, ignore_eos=True))[0]
    assert c.outputs[0].token_ids != a.outputs[0].token_ids


def test_max_tokens_stop_token_and_stop_string(llm):
    out = llm.generate(PROMPTS[0], GREEDY)[0].outputs[0]
    assert len(out.token_ids) == 24 and out.finish_reason == "length"
    stop_id = out.token_ids[5]
    first = out.token_ids.index(stop_id)
    by_id = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]))
    o = by_id[0].outputs[0]
    assert o.token_ids == out.token_ids[: first + 1] and o.finish_reason == "stop" and o.stop_reason == stop_id
    # a stop string taken from the greedy text: the output ends right before it
    text = out.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    by_str = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0].outputs[0]
    assert by_str.finish_reason == "stop" and by_str.stop_reason == stop
    assert by_str.text == text[: text.index(stop)]
    kept = SamplingParams(temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True)
    assert llm.generate(PROMPTS[0], kept)[0].outputs[0].text == text[: text.index(stop) + len(stop)]


def test_eos_ends_generation_unless_ignored(llm):
    eos = llm.engine.eos_token_ids[0]
    # min_tokens=0 and a prompt ending in a template turn: force eos via stop at a chosen token instead
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert eos not in out.token_ids[:-1]
    assert out.finish_reason in ("stop", "length")
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == eos


def test_logprobs_hold_sampled_token_and_top_n(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert tok in lp and 3 <= len(lp) <= 4
        assert lp[tok] == max(lp.values())  # greedy picks the most likely token
        assert all(v <= 0 for v in lp.values())
    assert out.cumulative_logprob == pytest.approx(
        sum(lp[t] for t, lp in zip(out.token_ids, out.logprobs, strict=True))
    )


def test_token_id_prompts_and_chat(llm):
    tok = llm.get_tokenizer()
    ids = tok(PROMPTS[1])["input_ids"]
    a = llm.generate({"prompt_token_ids": ids}, GREEDY)[0]
    b = llm.generate(PROMPTS[1], GREEDY)[0]
    assert a.prompt_token_ids == ids and a.outputs[0].token_ids == b.outputs[0].token_ids
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=4))[0]
    assert chat.prompt_token_ids[:1] == tok("<|im_start|>", add_special_tokens=False)["input_ids"]


def test_abort_frees_blocks_at_once(llm):
    eng = llm.engine
    eng.add_request("x", PROMPTS[3], SamplingParams(temperature=0, max_tokens=50))
    eng.step()
    assert eng.stats()["num_free_blocks"] < eng.stats()["num_total_blocks"]
    out = eng.abort_request("x")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert_pool_free(llm)
    assert eng.abort_request("x") is None


def test_prompt_logprobs_score_every_prompt_token(llama_dir):
    import torch
    import transformers

    llm = make(llama_dir, max_num_batched_tokens=9)  # chunked prefill: scores arrive over several steps
    prompt = PROMPTS[3]
    llm.generate(prompt, GREEDY)  # fill the prefix cache: prompt logprobs must still cover every token
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    ids = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1)
    for p in range(1, len(ids)):
        entry = out.prompt_logprobs[p]
        assert ids[p] in entry and 2 <= len(entry) <= 3
        assert entry[ids[p]] == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)


def test_profile_run_covers_the_largest_batch(llama_dir):
    """The KV-sizing forward: max_num_batched_tokens tokens in sequences of at most max_model_len,
    through the paged-attention path with a scratch cache; the real pool is left untouched."""
    llm = make(llama_dir, max_model_len=64, max_num_batched_tokens=150, num_kv_blocks=16)
    runner = llm.engine.runner
    pool_before = [k.clone() for k, _ in runner.kv_caches]
    scratch_bytes = runner.profile_run()
    a = runner.arch
    blocks = 4 + 4 + 2  # sequences of 64, 64 and 22 tokens in 16-token blocks
    assert scratch_bytes == blocks * 2 * a.num_layers * 16 * a.num_kv_heads * a.head_dim * 4
    assert all(torch.equal(k, b) for (k, _), b in zip(runner.kv_caches, pool_before, strict=True))
    assert_pool_free(llm)
