"""tests/greedy.py accepts a greedy divergence only at a near-tie of the reference's logits."""

from __future__ import annotations

import pytest
import torch

from tests.greedy import assert_greedy_agree


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
