"""tests/greedy.py accepts a greedy divergence only at a near-tie of the reference's logits (or, in
`assert_agree_by_own_logprobs`, of the reference run's own top logprobs)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.greedy import assert_agree_by_own_logprobs, assert_greedy_agree


def logits_with(gap: float):
    def logits_of(ids):
        out = torch.zeros(len(ids), 8)
        out[:, 3] = 5.0
        out[:, 4] = 5.0 - gap  # token 4 is the runner-up, `gap` behind
        return out

    return logits_of


def test_same_tokens_pass():
    assert_greedy_agree([3, 3], [3, 3], [1], logits_with(1.0))


def test_divergence_at_a_near_tie_passes():
    assert_greedy_agree([3, 4, 0], [3, 3, 3], [1], logits_with(1e-6))


def test_divergence_elsewhere_fails():
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_greedy_agree([3, 4], [3, 3], [1], logits_with(0.5))
    with pytest.raises(AssertionError):
        assert_greedy_agree([3], [3, 3], [1], logits_with(0.5))  # lengths differ


def run(tokens, logprobs):
    return SimpleNamespace(token_ids=tokens, logprobs=logprobs)


REF = run([3, 3, 3], [{3: -0.1, 4: -0.4, 5: -2.0}] * 3)


def test_own_logprobs_accept_a_near_tie_of_the_reference_run():
    got = run([3, 4, 0], [{3: -0.2, 4: -0.5}, {3: -0.35, 4: -0.3}, {0: -0.1}])
    assert_agree_by_own_logprobs(got, REF, margin=0.5, logprob_tol=0.5)


@pytest.mark.parametrize(
    "got,match",
    [
        (run([3, 5, 0], [{3: -0.2}, {5: -0.1}, {0: -0.1}]), "not a near-tie"),  # gap 1.9 in the reference run
        (run([3, 6, 0], [{3: -0.2}, {6: -0.1}, {0: -0.1}]), "not among"),  # not in its top logprobs
        (run([3, 3, 3], [{3: -0.1}, {3: -1.2}, {3: -0.1}]), "moved by"),  # a shared step's logprob moved 1.1
    ],
)
def test_own_logprobs_refuse_the_rest(got, match):
    with pytest.raises(AssertionError, match=match):
        assert_agree_by_own_logprobs(got, REF, margin=0.5, logprob_tol=0.5)
