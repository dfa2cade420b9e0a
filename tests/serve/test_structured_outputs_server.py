"""Structured outputs through the server: the official openai client on loopback, a tiny random
model whose output is valid only because the constraint makes it so. Two servers: the engine in
its own process with async scheduling (the engine compiles again on its thread), and the engine
on a thread with async scheduling off (the route's compile is the engine's cache hit)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from atomc.engine.structured_outputs import available
from atomc.serve.server import ServerThread, build_server_app
from tests.serve.test_server_api import make_config

pytestmark = pytest.mark.skipif(not available(), reason="xgrammar is not installed")

# bounded strings by pattern (see tests/engine/test_structured_outputs.py); no JSON whitespace
# freedom, which a random model would spend its tokens on
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "rank": {"enum": [1, 2, 3]}},
    "required": ["city", "rank"],
}
COMPACT = {"disable_any_whitespace": True}
MESSAGES = [{"role": "user", "content": "Which city?"}]


@pytest.fixture(scope="module", params=["process-async", "thread-sync"])
def client(request, llama_dir):
    process = request.param.startswith("process")
    cfg = make_config(llama_dir, engine_process="on" if process else "off")
    cfg.scheduler.async_scheduling = process
    app = build_server_app(cfg)
    with ServerThread(app, app.state.atomc.config) as st:
        c = openai.OpenAI(base_url=st.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        c.model_name = app.state.atomc.model_name
        yield c


def chat(client, **kw):
    kw.setdefault("max_tokens", 80)
    return client.chat.completions.create(model=client.model_name, messages=MESSAGES, temperature=0, **kw)


def test_json_schema_response_format(client):
    # OpenAI's shape; vLLM's structured_outputs.disable_any_whitespace rides in extra_body
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    r = chat(client, response_format=rf)
    # a random model with JSON whitespace allowed may not close the object in 80 tokens: check the
    # constraint held on what it did emit, then ask again without whitespace freedom
    text = r.choices[0].message.content
    assert text.lstrip().startswith("{")
    r = chat(client, extra_body={"structured_outputs": {"json": SCHEMA, **COMPACT}})
    doc = json.loads(r.choices[0].message.content)
    jsonschema.validate(doc, SCHEMA)
    assert r.choices[0].finish_reason == "stop"


def test_guided_json_regex_choice_and_grammar(client):
    r = chat(client, extra_body={"guided_json": SCHEMA})
    assert r.choices[0].message.content.lstrip().startswith("{")
    r = chat(client, extra_body={"guided_regex": r"[a-c]{3}-\d{2}"})
    assert re.fullmatch(r"[a-c]{3}-\d{2}", r.choices[0].message.content)
    r = client.chat.completions.create(
        model=client.model_name, messages=MESSAGES, temperature=1.0, seed=5, n=4, max_tokens=10,
        extra_body={"guided_choice": ["red", "green", "blue"]},
    )  # fmt: skip
    assert all(c.message.content in ("red", "green", "blue") for c in r.choices)
    r = chat(client, extra_body={"guided_grammar": 'root ::= "ab" ("c" | "d")+ "e"'})
    assert re.fullmatch(r"ab[cd]+e", r.choices[0].message.content)


def test_json_object_and_completions(client):
    r = chat(client, response_format={"type": "json_object"})
    assert r.choices[0].message.content.lstrip().startswith("{")
    r = client.completions.create(
        model=client.model_name, prompt="The capital of France is", max_tokens=40, temperature=0,
        extra_body={"structured_outputs": {"json": SCHEMA, **COMPACT}},
    )  # fmt: skip
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    r = client.completions.create(
        model=client.model_name, prompt="Once upon", max_tokens=20, temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )  # fmt: skip
    assert r.choices[0].text.lstrip().startswith("{")


def test_a_streamed_constrained_request(client):
    stream = chat(client, stream=True, extra_body={"structured_outputs": {"json": SCHEMA, **COMPACT}})
    text, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    jsonschema.validate(json.loads(text), SCHEMA)
    assert finish == "stop"


def test_mixed_requests_leave_unconstrained_ones_as_they_are_alone(client):
    import concurrent.futures

    def plain():
        return client.completions.create(model=client.model_name, prompt="1 2 3", max_tokens=24, temperature=0)

    alone = plain().choices[0].text
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        constrained = [pool.submit(chat, client, extra_body={"structured_outputs": {"json": SCHEMA, **COMPACT}})
                       for _ in range(3)]  # fmt: skip
        plains = [pool.submit(plain) for _ in range(3)]
        for f in constrained:
            jsonschema.validate(json.loads(f.result().choices[0].message.content), SCHEMA)
        assert all(f.result().choices[0].text == alone for f in plains)


@pytest.mark.parametrize(
    "extra, param",
    [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
      "response_format"),
     ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
     ({"guided_json": "{not json"}, "guided_json"),
     ({"guided_grammar": "root ::= nothing_here"}, "guided_grammar"),
     ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
     ({"response_format": {"type": "xml"}}, "response_format"),
     ({"structured_outputs": {"choice": []}}, "structured_outputs")],
)  # fmt: skip
def test_a_constraint_that_cannot_compile_is_a_400_naming_its_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, extra_body=extra)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param, e.value.body
    # the server still serves
    assert chat(client, max_tokens=2).choices[0].finish_reason == "length"


def test_the_responses_api_constrains_through_chat(client):
    """/v1/responses' `text.format` becomes chat's response_format: constrained, and its compile
    error names the Responses field."""
    r = client.responses.create(
        model=client.model_name, input="Which city?", max_output_tokens=16, temperature=0,
        text={"format": {"type": "json_object"}},
    )  # fmt: skip
    assert r.output_text.lstrip().startswith("{")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(
            model=client.model_name, input="x", max_output_tokens=4,
            text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}},
        )  # fmt: skip
    assert e.value.body["param"] == "text.format", e.value.body


def test_a_response_format_beside_a_constraining_tool_choice_is_a_400(client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, tools=tools, tool_choice="required", response_format={"type": "json_object"})
    assert e.value.body["param"] == "response_format", e.value.body
