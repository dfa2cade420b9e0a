"""logit_bias, allowed_token_ids and bad_words in the sampler (atomc/runtime/logit_edits.py), and the
best_of ranking logprob: against direct per-element references, through `Sampler`, and as properties
(hypothesis) over random rows. Plus the SamplingParams validation of the new fields."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atomc.outputs import CompletionOutput, RequestOutput, best_of
from atomc.runtime.logit_edits import (
    apply_allowed_token_ids,
    apply_bad_words,
    apply_logit_bias,
    apply_logit_edits,
    banned_by_bad_words,
)
from atomc.runtime.sampler import Sampler, SamplingBatch
from atomc.sampling_params import SamplingParams as SP

VOCAB = 16


def batch(params, outputs=None) -> SamplingBatch:
    n = len(params)
    gens = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
    return SamplingBatch(list(params), [[] for _ in range(n)], outputs or [[] for _ in range(n)], gens)


# ---------------------------------------------------------------- the edit functions


def test_allowed_token_ids_keeps_only_those_rows_tokens():
    x = torch.randn(3, VOCAB)
    before = x.clone()
    apply_allowed_token_ids(x, [0, 2], [[3, 5], [VOCAB + 4, 7]])  # an id past the vocab is ignored
    assert torch.equal(x[1], before[1])  # a row that did not ask is untouched
    for row, keep in ((0, {3, 5}), (2, {7})):
        for t in range(VOCAB):
            assert (x[row, t] == before[row, t]).item() if t in keep else x[row, t] == -math.inf


def test_logit_bias_adds_to_the_named_tokens_only():
    x = torch.zeros(2, VOCAB)
    apply_logit_bias(x, [1], [{2: 100.0, 9: -5.5, VOCAB: 3.0}])
    expected = torch.zeros(2, VOCAB)
    expected[1, 2], expected[1, 9] = 100.0, -5.5
    assert torch.equal(x, expected)


@pytest.mark.parametrize(
    ("words", "outputs", "banned"),
    [
        ([[4]], [], [4]),  # one token: always banned
        ([[4, 5]], [], []),  # its prefix has not been generated
        ([[4, 5]], [1, 4], [5]),
        ([[4, 5]], [4, 1], []),  # the prefix is not the latest output
        ([[4, 5, 6]], [4, 5], [6]),
        ([[4, 5, 6]], [5], []),  # shorter history than the prefix
        ([[4, 5], [7]], [4], [5, 7]),
    ],
)
def test_bad_words_ban_the_last_token_once_the_prefix_is_generated(words, outputs, banned):
    assert banned_by_bad_words(words, outputs) == banned


def test_apply_bad_words_masks_per_row():
    x = torch.zeros(2, VOCAB)
    apply_bad_words(x, [0, 1], [[[3, 4]], [[9]]], [[3], [1]])
    assert x[0, 4] == -math.inf and x[1, 9] == -math.inf
    assert (x == -math.inf).sum() == 2


def test_no_edit_rows_cost_nothing():
    x = torch.randn(4, VOCAB)
    assert apply_logit_edits(x, [SP(), SP(temperature=0)] * 2, [[]] * 4) is x  # not even a copy


# ---------------------------------------------------------------- through the sampler


def test_logit_bias_steers_greedy_and_random_rows():
    logits = torch.zeros(2, VOCAB)
    params = [SP(temperature=0, logit_bias={11: 50.0}), SP(temperature=1.0, seed=3, logit_bias={6: 100.0})]
    out = Sampler()(logits, batch(params))
    assert out.token_ids == [11, 6]


def test_allowed_token_ids_bound_every_draw():
    torch.manual_seed(0)
    allowed = [2, 8, 13]
    params = [SP(temperature=1.5, seed=i, allowed_token_ids=allowed) for i in range(32)]
    out = Sampler()(torch.randn(32, VOCAB) * 3, batch(params))
    assert set(out.token_ids) <= set(allowed)


def test_bad_word_blocks_its_last_token_after_its_prefix():
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 10.0  # greedy would pick 5
    p = SP(temperature=0)
    p.bad_words_token_ids = [[3, 5]]  # the engine's input processor tokenizes bad_words into these
    out = Sampler()(logits, batch([p, p], outputs=[[1, 3], [3, 1]]))
    assert out.token_ids[0] != 5  # prefix 3 was the last output: 5 is banned
    assert out.token_ids[1] == 5  # the prefix is not the latest output: nothing banned


def test_logprobs_stay_raw_under_edits():
    logits = torch.randn(1, VOCAB)
    out = Sampler()(logits, batch([SP(temperature=0, logprobs=2, logit_bias={4: 100.0})]))
    assert out.token_ids == [4]
    raw = torch.log_softmax(logits[0], -1)
    assert out.logprobs[0][4] == pytest.approx(raw[4].item(), abs=1e-5)


def test_best_of_rows_return_the_sampled_logprob_without_logprobs():
    logits = torch.randn(2, VOCAB)
    params = [SP(temperature=0, n=1, best_of=2), SP(temperature=0)]
    out = Sampler()(logits, batch(params))
    raw = torch.log_softmax(logits[0], -1)
    assert out.logprobs[0] == {out.token_ids[0]: pytest.approx(raw[out.token_ids[0]].item(), abs=1e-5)}
    assert out.logprobs[1] is None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    row=st.lists(st.floats(-30, 30, width=32), min_size=VOCAB, max_size=VOCAB),
    allowed=st.none() | st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6, unique=True),
    bias=st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=4),
    words=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3), max_size=3),
    history=st.lists(st.integers(0, VOCAB - 1), max_size=4),
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    seed=st.integers(0, 2**31),
)
def test_edits_property(row, allowed, bias, words, history, temperature, seed):
    """Whatever the edits, the sampled token is allowed, not banned by a completed bad word (unless
    that leaves nothing to draw), and the edited logits equal the direct per-element computation."""
    p = SP(temperature=temperature, seed=seed, allowed_token_ids=allowed, logit_bias=bias or None)
    p.bad_words_token_ids = words
    logits = torch.tensor([row])
    # the direct reference: walk the row in python
    banned = {w[-1] for w in words if len(w) - 1 <= len(history) and history[len(history) - (len(w) - 1) :] == w[:-1]}
    ref = []
    for t, v in enumerate(row):
        if (allowed is not None and t not in allowed) or t in banned:
            ref.append(-math.inf)
        else:
            ref.append(v + bias.get(t, 0.0))
    edited = apply_logit_edits(logits.clone(), [p], [history])
    assert torch.allclose(edited[0], torch.tensor(ref, dtype=torch.float32), atol=1e-4)
    out = Sampler()(logits, batch([p], outputs=[history]))
    token = out.token_ids[0]
    assert 0 <= token < VOCAB
    if any(math.isfinite(v) for v in ref):
        assert math.isfinite(ref[token]), (token, ref)
    else:
        assert out.num_fallbacks == 1 or temperature == 0.0


# ---------------------------------------------------------------- validation and best_of selection


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        (dict(logit_bias={1: 101.0}), "logit_bias"),
        (dict(logit_bias={1: math.nan}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
        (dict(bad_words=[""]), "bad_words"),
        (dict(bad_words=["  "]), "bad_words"),
        (dict(n=3, best_of=2), "best_of"),
        (dict(best_of=0), "best_of"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    ],
)
def test_new_fields_are_validated_by_name(kw, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        SP(**kw)


def test_reads_history_only_for_multi_token_bad_words():
    p = SP()
    p.bad_words_token_ids = [[5]]
    assert not p.reads_history and p.edits_logits
    p.bad_words_token_ids = [[5], [6, 7]]
    assert p.reads_history


def test_best_of_keeps_the_highest_cumulative_logprob():
    outs = [CompletionOutput(i, f"t{i}", [i], "stop", cumulative_logprob=lp) for i, lp in enumerate([-3.0, -1.0, -2.0])]
    picked = best_of(RequestOutput("r", "p", [1], outs, True), 2)
    assert [c.text for c in picked.outputs] == ["t1", "t2"]
    assert [c.index for c in picked.outputs] == [0, 1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_edits_on_cuda_match_cpu_and_queue_no_sync():
    """Same edits on CUDA logits as on CPU ones, queued without a device sync (a sync while async
    scheduling overlaps steps would undo the overlap)."""
    torch.manual_seed(0)
    logits = torch.randn(8, 512)
    p = SP(temperature=0.8, allowed_token_ids=list(range(0, 512, 3)), logit_bias={3: 5.0, 9: -100.0})
    p.bad_words_token_ids = [[6], [1, 9]]
    params = [p, SP(), p, SP(temperature=0)] * 2
    history = [[1], [], [2], [], [1], [], [], []]
    cpu = apply_logit_edits(logits.clone(), params, history)
    dev = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = apply_logit_edits(dev, params, history)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out.cpu(), cpu)
