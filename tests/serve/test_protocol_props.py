"""Property tests over the request models: any value a client can put in a sampling field becomes a
400 naming that field, or SamplingParams the sampler can use (finite, float32-representable)."""

from __future__ import annotations

import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from atomc.engine.process import OutputDeltas, _Assembly
from atomc.outputs import CompletionOutput, RequestOutput
from atomc.sampling_params import FLOAT_FIELDS, as_float32
from atomc.serve.api_errors import APIError
from atomc.serve.chat_request import ChatCompletionRequest
from atomc.serve.completion_request import CompletionRequest
from atomc.serve.request_body import parse_request

FIELDS = [*FLOAT_FIELDS, "n", "top_k", "max_tokens", "min_tokens", "seed", "logprobs"]
VALUES = (
    st.floats(allow_nan=True, allow_infinity=True)
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.sampled_from([5e-324, 1e-46, 1e39, -1e39, True, "1", None, [], {}])
)


@settings(max_examples=400, deadline=None)
@given(field=st.sampled_from(FIELDS), value=VALUES, chat=st.booleans())
def test_any_value_is_a_400_naming_the_field_or_usable(field, value, chat):
    if chat and field == "logprobs":
        field = "top_logprobs"
    base = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    # through JSON as a client sends it: NaN and Infinity are what Python's json module writes
    body = json.loads(json.dumps({**base, field: value}, allow_nan=True))
    try:
        req = parse_request(ChatCompletionRequest if chat else CompletionRequest, body)
        if chat and field == "top_logprobs" and value is not None:
            req.logprobs = True
        params = req.sampling_params({})
    except APIError as e:
        assert e.status == 400 and e.param == field, (e.param, e.message)
        return
    for name in FLOAT_FIELDS:
        v = getattr(params, name)
        assert math.isfinite(v) and (v == 0 or as_float32(v) != 0), (name, v)


def test_engine_process_deltas_carry_a_request_error():
    deltas = OutputDeltas()
    out = RequestOutput("r", "p", [1], [CompletionOutput(0, "x", [7], "abort")], True, error="boom")
    assembly = _Assembly("r", "p", [1], 1)
    rebuilt = assembly.apply(deltas.encode(out))
    assert rebuilt.error == "boom" and rebuilt.finished
