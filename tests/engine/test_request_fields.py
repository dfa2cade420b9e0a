"""The newer request fields in the engine and the offline `LLM` API: best_of (the n best of best_of
samples), truncate_prompt_tokens, the vocabulary checks of logit_bias / allowed_token_ids, and how
bad_words become token ids (vLLM's two spellings)."""

from __future__ import annotations

import pytest

from atomc import SamplingParams
from atomc.engine.inputs import bad_words_token_ids
from tests.engine.helpers import PROMPTS, assert_pool_free, make

# a toy word-piece encoder: a leading space makes a different first piece, as byte-level BPEs do
PIECES = {"cat": [10], " cat": [11], "dog": [12, 13], " dog": [14, 13], "bird": [15], " bird": [16, 17]}


def encode(text: str) -> list[int]:
    return list(PIECES.get(text, []))


def test_bad_words_take_both_spellings_when_they_are_alike():
    assert bad_words_token_ids(["cat"], encode, 100) == [[10], [11]]
    assert bad_words_token_ids([" dog"], encode, 100) == [[12, 13], [14, 13]]  # leading spaces dropped first
    # the spaced spelling has another length: a different word, not banned
    assert bad_words_token_ids(["bird"], encode, 100) == [[15]]
    with pytest.raises(ValueError, match="^bad_words: 'fish' tokenizes to no token"):
        bad_words_token_ids(["fish"], encode, 100)
    with pytest.raises(ValueError, match="^bad_words tokenize to ids outside the vocabulary"):
        bad_words_token_ids(["dog"], encode, 13)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return make(llama_dir)


def test_best_of_returns_the_n_best_samples(llm):
    kw = dict(temperature=1.0, seed=21, max_tokens=6, ignore_eos=True)
    every = llm.generate(PROMPTS[0], SamplingParams(n=4, logprobs=0, **kw))[0].outputs
    best = sorted(every, key=lambda c: -c.cumulative_logprob)
    picked = llm.generate(PROMPTS[0], SamplingParams(n=2, best_of=4, **kw))[0].outputs
    assert [c.index for c in picked] == [0, 1]
    assert [c.token_ids for c in picked] == [c.token_ids for c in best[:2]]
    assert picked[0].cumulative_logprob == pytest.approx(best[0].cumulative_logprob, abs=1e-5)
    assert picked[0].logprobs is None  # ranked without returning logprobs nobody asked for
    assert_pool_free(llm)


def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    ids = llm.get_tokenizer()(PROMPTS[3])["input_ids"]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    cut = llm.generate(
        PROMPTS[3], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, truncate_prompt_tokens=4)
    )[0]
    assert cut.prompt_token_ids == ids[-4:]
    assert cut.outputs[0].token_ids == llm.generate({"prompt_token_ids": ids[-4:]}, greedy)[0].outputs[0].token_ids


@pytest.mark.parametrize("field", ["logit_bias", "allowed_token_ids"])
def test_token_ids_outside_the_vocabulary_are_refused(llm, field):
    vocab = llm.engine.arch.vocab_size
    value = {vocab: 1.0} if field == "logit_bias" else [vocab]
    with pytest.raises(ValueError, match=f"^{field} holds token ids outside the vocabulary"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, **{field: value}))
    assert_pool_free(llm)


def test_min_tokens_holds_stop_strings_back_as_vllm(llm):
    """A stop string ending in the text of the first min_tokens tokens does not stop the output;
    one ending in the next token's does (vLLM checks stop strings once min_tokens are out)."""
    tok = llm.get_tokenizer()
    base = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = llm.generate(PROMPTS[1], base)[0].outputs[0].token_ids
    texts = [tok.decode(ids[: i + 1]) for i in range(len(ids))]
    # the first position whose text adds something new that was not seen before: a stop string there
    k = next(
        i for i in range(1, len(ids)) if texts[i][len(texts[i - 1]) :].strip() and texts[i][-1] not in texts[i - 1]
    )
    stop = texts[k][-1]  # its last character, first seen in token k + 1's text
    kw = dict(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    early = llm.generate(PROMPTS[1], SamplingParams(min_tokens=k, **kw))[0].outputs[0]
    assert (early.finish_reason, early.stop_reason, len(early.token_ids)) == ("stop", stop, k + 1)
    held = llm.generate(PROMPTS[1], SamplingParams(min_tokens=k + 1, **kw))[0].outputs[0]
    assert len(held.token_ids) > k + 1 or held.finish_reason == "length"
    assert held.text.startswith(texts[k])  # the stop string in token k + 1's text did not cut it
