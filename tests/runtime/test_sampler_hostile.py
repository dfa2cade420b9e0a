"""The sampler can never return an id outside [0, vocab), whatever the logits and parameters.

Property-based (hypothesis): any float a client can send is either refused by `SamplingParams` with
a ValueError that names the field, or sampled into a token in range; rows that have nothing left to
draw from (NaN or inf logits, every token masked) take the documented fallback and are counted.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atomc.runtime.sampler import Sampler, SamplingBatch, fallback_tokens
from atomc.sampling_params import FLOAT_FIELDS
from atomc.sampling_params import SamplingParams as SP

VOCAB = 32
# every float JSON (as Python parses it) can carry: NaN, +-inf, subnormals, past float32's range
ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [5e-324, 1e-46, 1e-39, 1e39, -1e39, 3.5e38, 1e-5, 0.0, -0.0, 1.0, 2.0]
)


def batch(params, outputs=None) -> SamplingBatch:
    n = len(params)
    gens = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
    return SamplingBatch(list(params), [[1, 2, 3]] * n, outputs or [[4, 5]] * n, gens)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", 1e39),  # inf in float32
        ("top_p", 5e-324),  # 0 in float32: no token would be kept
        ("top_p", math.nan),
        ("repetition_penalty", 1e-46),  # 0 in float32: logits / 0
        ("repetition_penalty", math.inf),
        ("repetition_penalty", math.nan),
        ("min_p", math.nan),
        ("presence_penalty", -math.inf),
        ("frequency_penalty", math.nan),
    ],
)
def test_values_the_sampler_cannot_cast_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        SP(**{field: value})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(FLOAT_FIELDS), value=ANY_FLOAT, logprobs=st.sampled_from([None, 0, 3]))
def test_any_float_is_refused_or_sampled_in_range(field, value, logprobs):
    try:
        p = SP(**{field: value}, logprobs=logprobs, seed=0)
    except ValueError as e:
        assert str(e).startswith(field)
        return
    logits = torch.randn(2, VOCAB) * 10
    out = Sampler()(logits, batch([p, SP(temperature=0.7, top_p=0.9, seed=1)]))
    assert all(0 <= t < VOCAB for t in out.token_ids), out.token_ids
    if logprobs is not None:
        assert out.token_ids[0] in out.logprobs[0]


HOSTILE_LOGITS = st.lists(
    st.floats(allow_nan=True, allow_infinity=True, width=32) | st.sampled_from([math.nan, math.inf, -math.inf]),
    min_size=VOCAB,
    max_size=VOCAB,
)


@settings(max_examples=200, deadline=None)
@given(
    row=HOSTILE_LOGITS,
    temperature=st.sampled_from([0.0, 1e-4, 0.5, 1.0, 3e38]),
    top_p=st.sampled_from([1.0, 0.5, 1.2e-38]),
    top_k=st.sampled_from([0, 1, 5]),
    min_p=st.sampled_from([0.0, 0.5, 1.0]),
    repetition_penalty=st.sampled_from([1.0, 1.2e-38, 3e38]),
)
def test_hostile_logits_never_give_an_id_out_of_range(row, temperature, top_p, top_k, min_p, repetition_penalty):
    p = SP(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty)
    out = Sampler()(torch.tensor([row], dtype=torch.float32), batch([p]))
    assert 0 <= out.token_ids[0] < VOCAB


def test_fully_masked_row_falls_back_to_the_argmax_and_is_counted():
    # inf logits: softmax gives NaN, so the row has no CDF; an all-NaN row has no argmax either
    logits = torch.zeros(3, VOCAB)
    logits[0, 7] = math.inf
    logits[1] = math.nan
    logits[2, 9] = 5.0  # a healthy row in the same batch samples as usual
    params = [SP(temperature=1.0), SP(temperature=1.0), SP(temperature=1e-3)]
    out = Sampler()(logits, batch(params))
    assert out.token_ids[0] == 7  # the argmax of the unmasked logits
    assert out.token_ids[1] == 0  # all NaN: argmax of all -inf, the first id
    assert out.token_ids[2] == 9
    assert out.num_fallbacks == 2


def test_fallback_reads_nan_as_minus_inf():
    row = torch.tensor([[math.nan, 1.0, math.nan, 3.0]])
    assert fallback_tokens(row).tolist() == [3]


def test_healthy_rows_count_no_fallback():
    out = Sampler()(torch.randn(4, VOCAB), batch([SP(temperature=0.8, seed=i) for i in range(4)]))
    assert out.num_fallbacks == 0
