"""/v1/responses and /v1/messages end to end: a real server on loopback, a tiny llama, the official
openai SDK's `client.responses.create` (streamed and not), the anthropic SDK and raw HTTP in the
Messages API's shapes. Both are the chat pipeline underneath, so greedy answers must match chat's."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from atomc.config import EngineConfig
from atomc.engine.client import EngineClient
from atomc.outputs import CompletionOutput, RequestOutput
from atomc.serve.api import build_app
from atomc.serve.async_engine import AsyncEngine
from atomc.serve.server import ServerThread, build_server_app

KEY = "sk-test-key"
PROMPT = "The capital of France"


@pytest.fixture(scope="module")
def server(llama_dir):
    cfg = EngineConfig(device="cpu")
    cfg.model.model = str(llama_dir)
    cfg.model.max_model_len = 128
    cfg.compile.enforce_eager = True
    cfg.cache.num_kv_blocks = 64
    cfg.serve.api_key = KEY
    app = build_server_app(cfg)
    with ServerThread(app, cfg) as st:
        st.state = app.state.atomc
        yield st


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(server) -> str:
    return server.state.model_name


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers={"x-api-key": KEY}, timeout=60) as c:
        yield c


def chat_text(client, model, messages, max_tokens=8, **extra) -> tuple[str, str]:
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, extra_body=extra or None
    )
    return r.choices[0].message.content, r.choices[0].finish_reason


# ---------------------------------------------------------------- /v1/responses


def test_responses_text_matches_chat(client, model):
    r = client.responses.create(model=model, input=PROMPT, max_output_tokens=8, temperature=0)
    text, finish = chat_text(client, model, [{"role": "user", "content": PROMPT}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == model
    assert r.output_text == text
    assert r.status == ("incomplete" if finish == "length" else "completed")
    assert r.usage.input_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.store is False


def test_responses_instructions_items_and_length(client, model):
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"role": "user", "content": PROMPT},
    ]
    r = client.responses.create(
        model=model,
        instructions="Answer.",
        input=items,
        max_output_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    messages = [{"role": "system", "content": "Answer."}, {"role": "user", "content": "Hi"}]
    messages += [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": PROMPT}]
    text, _ = chat_text(client, model, messages, max_tokens=6, ignore_eos=True)
    assert r.output_text == text and r.usage.output_tokens == 6
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_responses_stream(client, model):
    kw = dict(model=model, input=PROMPT, max_output_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-1] == "response.incomplete" and "response.output_text.done" in types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 8


def test_responses_stream_helper_completed(client, model):
    """The SDK's stream helper wants `response.completed`: a stop string ends the answer before
    max_output_tokens does (which would end it `response.incomplete`, as OpenAI's API does too)."""
    text, _ = chat_text(client, model, [{"role": "user", "content": PROMPT}], max_tokens=12, ignore_eos=True)
    stop = text.strip()[2:4]
    kw = dict(model=model, input=PROMPT, max_output_tokens=12, temperature=0)
    with client.responses.stream(**kw, extra_body={"stop": [stop], "ignore_eos": True}) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == text[: text.find(stop)]


@pytest.mark.parametrize(
    "kw, param",
    [
        (dict(store=True), "store"),
        (dict(previous_response_id="resp_123"), "previous_response_id"),
        (dict(background=True), "background"),
        (dict(tools=[{"type": "web_search"}]), "tools"),
        (dict(max_output_tokens=0), "max_output_tokens"),
        (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]), "input"),
        (dict(input="x " * 400), "input"),  # longer than the context
        (dict(text={"format": {"type": "yaml"}}), "text.format"),
    ],
)
def test_responses_bad_requests_are_400(client, model, kw, param):
    kw = {"input": PROMPT, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, **kw)
    assert e.value.body["param"] == param, e.value.body


def test_responses_unknown_model_and_key(client, server):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input=PROMPT)
    r = httpx.post(server.base_url + "/v1/responses", json={"input": PROMPT})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_responses_tools_reach_chat(client, model):
    """The tools translate and reach chat's own check: this server has no --enable-auto-tool-choice,
    so tool_choice "auto" is chat's 400 (tool calls themselves: tests/serve/test_server_tools.py)."""
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input=PROMPT, tools=[tool], max_output_tokens=4)
    assert e.value.body["param"] == "tool_choice" and "--enable-auto-tool-choice" in e.value.body["message"]


# ---------------------------------------------------------------- /v1/messages


def messages_body(model, **kw) -> dict:
    return {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0, **kw}


def test_messages_text_matches_chat(http, client, model):
    r = http.post("/v1/messages", json=messages_body(model, system="Answer."))
    assert r.status_code == 200, r.text
    m = r.json()
    text, finish = chat_text(
        client, model, [{"role": "system", "content": "Answer."}, {"role": "user", "content": PROMPT}]
    )
    assert m["type"] == "message" and m["role"] == "assistant" and m["id"].startswith("msg_")
    assert m["content"] == [{"type": "text", "text": text}]
    assert m["stop_reason"] == ("max_tokens" if finish == "length" else "end_turn")
    u = m["usage"]
    assert u["input_tokens"] + u["cache_read_input_tokens"] > 0 and u["output_tokens"] > 0


def test_messages_stop_sequence(http, client, model):
    text, _ = chat_text(client, model, [{"role": "user", "content": PROMPT}], max_tokens=12, ignore_eos=True)
    stop = text.strip()[2:4]
    assert len(stop) == 2, text
    m = http.post("/v1/messages", json=messages_body(model, max_tokens=12, stop_sequences=[stop])).json()
    assert m["stop_reason"] == "stop_sequence" and m["stop_sequence"] == stop
    assert m["content"][0]["text"] == text[: text.find(stop)]


def test_messages_stream_raw_events(http, model):
    whole = http.post("/v1/messages", json=messages_body(model)).json()
    with http.stream("POST", "/v1/messages", json=messages_body(model, stream=True)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    events = []
    for block in raw.strip().split("\n\n"):
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        events.append(json.loads(data[6:]))
        assert events[-1]["type"] == name[7:]
    assert [e["type"] for e in events][:3] == ["message_start", "ping", "content_block_start"]
    assert [e["type"] for e in events][-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == whole["content"][0]["text"]
    assert events[-2]["delta"]["stop_reason"] == whole["stop_reason"]
    assert events[-2]["usage"]["output_tokens"] == whole["usage"]["output_tokens"]


def test_messages_with_the_anthropic_sdk(server, http, model):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)
    whole = http.post("/v1/messages", json=messages_body(model)).json()
    # this SDK's create() takes no temperature (newer Anthropic models have none): send it as an extra field
    kw = dict(model=model, max_tokens=8, messages=[{"role": "user", "content": PROMPT}], extra_body={"temperature": 0})
    m = client.messages.create(**kw)
    assert m.content[0].text == whole["content"][0]["text"] and m.stop_reason == whole["stop_reason"]
    with client.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    assert streamed.content[0].text == m.content[0].text and streamed.usage.output_tokens == m.usage.output_tokens
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=model, max_tokens=0, messages=[{"role": "user", "content": PROMPT}])
    assert e.value.body["error"]["type"] == "invalid_request_error"


def anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind
    return body["error"]["message"]


def test_messages_errors_have_the_api_shape(server, http, model):
    url = "/v1/messages"
    anthropic_error(
        http.post(url, json={"model": model, "messages": [{"role": "user", "content": "hi"}]}),
        400,
        "invalid_request_error",
    )
    anthropic_error(
        http.post(url, content=b"{not json", headers={"content-type": "application/json"}), 400, "invalid_request_error"
    )
    anthropic_error(http.post(url, json=messages_body("claude-nope")), 404, "not_found_error")
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}]
    assert "image" in anthropic_error(
        http.post(url, json=messages_body(model, messages=image)), 400, "invalid_request_error"
    )
    tools = [{"type": "bash_20250124", "name": "bash"}]
    anthropic_error(http.post(url, json=messages_body(model, tools=tools)), 400, "invalid_request_error")
    anthropic_error(
        http.post(url, json=messages_body(model, max_tokens=1000)), 400, "invalid_request_error"
    )  # > context
    # the key: x-api-key (what Anthropic clients send) or Authorization: Bearer; a wrong one is a 401
    anon = httpx.Client(base_url=server.base_url, timeout=30)
    anthropic_error(anon.post(url, json=messages_body(model)), 401, "authentication_error")
    anthropic_error(
        anon.post(url, json=messages_body(model), headers={"x-api-key": "wrong"}), 401, "authentication_error"
    )
    ok = anon.post(url, json=messages_body(model), headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200, ok.text
    # x-api-key is the Messages API's header, not the OpenAI routes'
    assert anon.post("/v1/responses", json={"input": "hi"}, headers={"x-api-key": KEY}).status_code == 401


def test_routes_have_their_own_metrics_label(server, http, model):
    http.post("/v1/messages", json=messages_body(model, max_tokens=1))
    httpx.post(
        server.base_url + "/v1/responses",
        json={"input": "hi", "max_output_tokens": 1},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    text = httpx.get(server.base_url + "/metrics").text
    assert 'route="/v1/messages",status="200"' in text and 'route="/v1/responses",status="200"' in text


# ---------------------------------------------------------------- engine failure, on a scripted engine


class ScriptedEngine(EngineClient):
    """The last message decides: "bad" is failed as a failed engine step fails a request; anything
    else is answered "Hello" in two steps."""

    model_name, max_model_len, tokenizer, sampling_defaults = "fake", 64, None, {}

    def __init__(self):
        self.live: dict[str, list] = {}

    def apply_chat_template(self, messages, chat_template=None):
        return messages[-1]["content"]

    def add_request(self, request_id, prompt, params, arrival_time=None, add_special_tokens=True):
        self.live[request_id] = [prompt, 0]

    def abort_request(self, request_id):
        self.live.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        time.sleep(0.005)
        outs = []
        for rid, state in list(self.live.items()):
            prompt, state[1] = state[0], state[1] + 1
            if prompt == "bad":
                out = RequestOutput(rid, prompt, [1], [CompletionOutput(0, "x", [7], "abort")], True)
                out.error = "IndexError: internal detail"
            else:
                done = state[1] == 2
                text = "Hello" if done else "Hel"
                out = RequestOutput(
                    rid, prompt, [1, 2], [CompletionOutput(0, text, [7] * state[1], "stop" if done else None)], done
                )
            if out.finished:
                del self.live[rid]
            outs.append(out)
        return outs

    def stats(self):
        return {"num_running": len(self.live), "num_waiting": 0}


def sse_events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def test_engine_failure_in_each_api_shape():
    app = build_app(AsyncEngine(ScriptedEngine()), EngineConfig())
    with ServerThread(app, EngineConfig()) as st, httpx.Client(base_url=st.base_url, timeout=10) as c:
        ok = c.post("/v1/responses", json={"input": "hi"}).json()
        assert ok["output"][0]["content"][0]["text"] == "Hello" and ok["status"] == "completed"
        err = c.post("/v1/responses", json={"input": "bad"})
        assert err.status_code == 500 and err.json()["error"]["code"] == "engine_failed"
        assert "internal detail" not in err.text
        with c.stream("POST", "/v1/responses", json={"input": "bad", "stream": True}) as r:
            events = sse_events(r)
        assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"]
        assert events[-1]["response"]["status"] == "failed" and "internal detail" not in json.dumps(events)

        body = {"model": "fake", "max_tokens": 8, "messages": [{"role": "user", "content": "bad"}]}
        err = c.post("/v1/messages", json=body)
        assert err.status_code == 500 and err.json()["error"]["type"] == "api_error"
        assert err.json()["type"] == "error" and "internal detail" not in err.text
        with c.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            events = sse_events(r)
        assert events == [{"type": "error", "error": {"type": "api_error", "message": events[0]["error"]["message"]}}]
        # the server keeps serving
        body["messages"][0]["content"] = "hi"
        assert c.post("/v1/messages", json=body).json()["content"] == [{"type": "text", "text": "Hello"}]
