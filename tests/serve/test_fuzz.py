"""Fuzz the HTTP API: hypothesis draws request bodies (every field of the request models, each with
any JSON value: NaN, Infinity, huge ints, lone surrogates, deep nesting, wrong types) and posts them
to a real CPU server, on every generation route (completions, chat, responses, messages). No body may give
a 5xx or take the server down. Budget: about a minute on 2 cores."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atomc.config import EngineConfig
from atomc.serve.server import ServerThread, build_server_app

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, -1, 2, 16, 127, 128, 2**31, 2**63, -(2**63)])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([math.nan, math.inf, -math.inf, 5e-324, 1e-46, 1e39, 3.5e38, 1e-5, 0.5, 1.0, 2.0])
    | st.text(max_size=20)
    | st.sampled_from(["\ud800", "a\udfffb", "\ud83d", "", " ", "hi"])
)
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
NUMBERS = (
    st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([math.nan, math.inf, -math.inf, 5e-324, 1e-46, 1e39, 3.5e38, 1e-5, 0.0, 0.5, 1.0, 2.0])
    | st.integers(min_value=-3, max_value=20)
)
# mostly numbers, so a drawn body is often valid apart from one hostile value (a body wrong in five
# fields at once only ever meets the first check)
VALUE = NUMBERS | NUMBERS | st.booleans() | ANY_JSON
FIELD_NAMES = [
    "model", "n", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids",
    "ignore_eos", "min_tokens", "skip_special_tokens", "include_stop_str_in_output", "stream",
    "stream_options", "logit_bias", "logprobs", "top_logprobs", "echo", "best_of", "user", "response_format",
    "allowed_token_ids", "bad_words", "prompt_logprobs", "truncate_prompt_tokens", "suffix", "tools",
    "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "structured_outputs", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar",
]  # fmt: skip
EXTRA = st.dictionaries(st.sampled_from(FIELD_NAMES), VALUE, max_size=3)
PROMPTS = st.sampled_from(["hi", ["a", "b"], [1, 2, 3], [[5, 6], [7]], "\ud800", ""]) | ANY_JSON
MESSAGES = st.sampled_from([[{"role": "user", "content": "hi"}]]) | st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]) | ANY_JSON},
        optional={"content": st.text(max_size=20) | ANY_JSON},
    ),
    max_size=3,
)
BASE = {"max_tokens": 4}
COMPLETION = st.builds(lambda p, extra: {**BASE, "prompt": p, **extra}, st.just("hi") | PROMPTS, EXTRA)
CHAT = st.builds(lambda m, extra: {**BASE, "messages": m, **extra}, MESSAGES, EXTRA)
# /v1/responses and /v1/messages: their own fields, plus items / content blocks of every kind
RESPONSES_FIELDS = [
    "model", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
    "parallel_tool_calls", "text", "stream", "metadata", "store", "previous_response_id", "background",
    "include", "reasoning", "truncation", "top_logprobs", "top_k", "seed", "stop", "ignore_eos",
]  # fmt: skip
ITEM = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "item_reference"])
        | ANY_JSON,
        "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]) | ANY_JSON,
        "content": st.text(max_size=10)
        | st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["input_text", "input_image"]), "text": st.text(max_size=5) | ANY_JSON}
            ),
            max_size=2,
        )
        | ANY_JSON,  # noqa: E501
        "call_id": st.text(max_size=5) | ANY_JSON,
        "name": st.text(max_size=5) | ANY_JSON,
        "arguments": st.just("{}") | ANY_JSON,
        "output": st.text(max_size=5) | ANY_JSON,
    },
)
RESPONSES_INPUT = st.sampled_from(["hi", [{"role": "user", "content": "hi"}]]) | st.lists(ITEM, max_size=3) | ANY_JSON
RESPONSES = st.builds(
    lambda i, extra: {"max_output_tokens": 4, "input": i, **extra},
    RESPONSES_INPUT,
    st.dictionaries(st.sampled_from(RESPONSES_FIELDS), VALUE, max_size=3),
)
MESSAGES_FIELDS = [
    "model", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k", "stream", "tools",
    "tool_choice", "metadata", "thinking",
]  # fmt: skip
BLOCK = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "image", "thinking"]) | ANY_JSON},
    optional={
        "text": st.text(max_size=10) | ANY_JSON,
        "id": st.text(max_size=5) | ANY_JSON,
        "name": st.text(max_size=5) | ANY_JSON,
        "input": st.just({}) | ANY_JSON,
        "tool_use_id": st.text(max_size=5) | ANY_JSON,
        "content": st.text(max_size=5) | ANY_JSON,
    },
)
ANTHROPIC_MESSAGES = st.sampled_from([[{"role": "user", "content": "hi"}]]) | st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system"]) | ANY_JSON},
        optional={"content": st.text(max_size=10) | st.lists(BLOCK, max_size=3) | ANY_JSON},
    ),
    max_size=3,
)
MESSAGES_API = st.builds(
    lambda m, extra: {"model": "llama", "max_tokens": 4, "messages": m, **extra},
    ANTHROPIC_MESSAGES,
    st.dictionaries(st.sampled_from(MESSAGES_FIELDS), VALUE, max_size=3),
)


@pytest.fixture(scope="module")
def base_url(llama_dir):
    cfg = EngineConfig(device="cpu")
    cfg.model.model = str(llama_dir)
    cfg.model.max_model_len = 64
    cfg.compile.enforce_eager = True
    cfg.cache.num_kv_blocks = 64
    cfg.serve.max_seqs_per_request = 8  # keeps every accepted request small: the fuzz is about inputs
    app = build_server_app(cfg)
    with ServerThread(app, cfg) as st_:
        yield st_.base_url


def _post(client: httpx.Client, path: str, body) -> None:
    raw = json.dumps(body, allow_nan=True, ensure_ascii=True)  # NaN / Infinity / \ud800 as clients send them
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text, raw[:500])
    streamed = "text/event-stream" in r.headers.get("content-type", "")
    if r.status_code >= 400 and path == "/v1/messages":  # Anthropic's error shape
        body = r.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    elif r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
    elif streamed and path == "/v1/responses":  # named events, no [DONE]
        last = r.text.rstrip().rsplit("\n\n", 1)[-1]
        assert last.startswith(("event: response.completed", "event: response.incomplete")), r.text[-500:]
    elif streamed and path == "/v1/messages":
        assert r.text.rstrip().endswith('data: {"type":"message_stop"}'), r.text[-500:]
        assert "event: error" not in r.text, r.text[-500:]
    elif streamed:
        assert r.text.rstrip().endswith("data: [DONE]")
        assert '"error"' not in r.text, r.text[-500:]


FUZZ = settings(
    max_examples=80,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


@FUZZ
@given(body=COMPLETION)
def test_fuzz_completions(base_url, body):
    with httpx.Client(base_url=base_url, timeout=60) as client:
        _post(client, "/v1/completions", body)


@FUZZ
@given(body=CHAT)
def test_fuzz_chat(base_url, body):
    with httpx.Client(base_url=base_url, timeout=60) as client:
        _post(client, "/v1/chat/completions", body)


@FUZZ
@given(body=RESPONSES)
def test_fuzz_responses(base_url, body):
    with httpx.Client(base_url=base_url, timeout=60) as client:
        _post(client, "/v1/responses", body)


@FUZZ
@given(body=MESSAGES_API)
def test_fuzz_messages(base_url, body):
    with httpx.Client(base_url=base_url, timeout=60) as client:
        _post(client, "/v1/messages", body)


SAMPLING_FIELDS = [
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "n", "max_tokens", "min_tokens", "logprobs", "seed",
    "best_of", "prompt_logprobs", "truncate_prompt_tokens",
]  # fmt: skip


@FUZZ
@given(field=st.sampled_from(SAMPLING_FIELDS), value=NUMBERS, stream=st.booleans())
def test_fuzz_one_sampling_field(base_url, field, value, stream):
    """A valid request but for one number: what a client of the official openai SDK can send."""
    with httpx.Client(base_url=base_url, timeout=60) as client:
        _post(client, "/v1/completions", {**BASE, "prompt": "hi", "stream": stream, field: value})


# token-level values: ids in and out of the vocabulary, huge and negative, any bias
TOKEN_ID = st.integers(min_value=-3, max_value=300) | st.sampled_from([2**31, 2**63, 10**9]) | ANY_JSON
TOKEN_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "logit_bias": st.dictionaries(st.text(max_size=4) | TOKEN_ID.map(str), NUMBERS, max_size=3) | ANY_JSON,
        "allowed_token_ids": st.lists(TOKEN_ID, max_size=4) | ANY_JSON,
        "bad_words": st.lists(st.text(max_size=6), max_size=3) | ANY_JSON,
        "stream": st.booleans(),
    },
)


@FUZZ
@given(fields=TOKEN_FIELDS)
def test_fuzz_token_fields(base_url, fields):
    with httpx.Client(base_url=base_url, timeout=60) as client:
        _post(client, "/v1/completions", {**BASE, "prompt": "hi", **fields})


TOKENIZE_FIELDS = {
    "prompt": st.text(max_size=20) | ANY_JSON,
    "messages": MESSAGES | ANY_JSON,
    "add_special_tokens": st.booleans() | ANY_JSON,
    "add_generation_prompt": st.booleans() | ANY_JSON,
    "continue_final_message": st.booleans() | ANY_JSON,
    "return_token_strs": st.booleans() | ANY_JSON,
    "model": st.sampled_from(["llama", "nope"]) | ANY_JSON,
    "tools": ANY_JSON,
    "chat_template_kwargs": ANY_JSON,
}
TOKENIZE = st.fixed_dictionaries({}, optional=TOKENIZE_FIELDS)


@FUZZ
@given(body=TOKENIZE | ANY_JSON)
def test_fuzz_tokenize(base_url, body):
    with httpx.Client(base_url=base_url, timeout=60) as client:
        _post(client, "/tokenize", body)


@FUZZ
@given(body=st.fixed_dictionaries({"tokens": st.lists(TOKEN_ID, max_size=6) | ANY_JSON}) | ANY_JSON)
def test_fuzz_detokenize(base_url, body):
    with httpx.Client(base_url=base_url, timeout=60) as client:
        _post(client, "/detokenize", body)


def test_still_healthy_after_the_fuzz(base_url):
    assert httpx.get(base_url + "/health").status_code == 200


def test_the_fuzz_covers_every_declared_field(base_url):
    """Every field the OpenAPI document declares for a route is one the fuzz above draws: a new
    request field (or model) cannot land without being fuzzed."""
    schemas = httpx.get(base_url + "/openapi.json").json()["components"]["schemas"]
    generation = set(schemas["CompletionRequest"]["properties"]) | set(schemas["ChatCompletionRequest"]["properties"])
    assert generation - {"prompt", "messages"} <= set(FIELD_NAMES)
    tokenize = set(schemas["TokenizeCompletionRequest"]["properties"]) | set(
        schemas["TokenizeChatRequest"]["properties"]
    )
    assert tokenize <= set(TOKENIZE_FIELDS)
    assert set(schemas["DetokenizeRequest"]["properties"]) <= {"model", "tokens"}
