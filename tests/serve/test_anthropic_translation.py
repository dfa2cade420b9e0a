"""The Messages API translation, without a server: requests into chat-completions bodies, chat
output (whole and streamed, text and tool calls) into Messages objects and events, errors into
that API's shape. Shapes are checked against the official anthropic SDK's own types."""

from __future__ import annotations

import json

import pytest
from pydantic import TypeAdapter

from atomc.serve.anthropic_api import (
    AnthropicMessagesRequest,
    MessagesStream,
    chat_messages,
    chat_tool_choice,
    chat_tools,
    content_blocks,
    error_body,
    message_from_chat,
    rename_chat_error,
    stop_reason,
    to_chat_request,
)
from atomc.serve.api_errors import APIError, bad_request

anthropic_types = pytest.importorskip("anthropic.types")
EVENTS = TypeAdapter(anthropic_types.RawMessageStreamEvent)
USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4}}


def req(**kw) -> AnthropicMessagesRequest:
    return AnthropicMessagesRequest.model_validate(
        {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **kw}
    )


def refused(param: str, **kw) -> APIError:
    with pytest.raises(APIError) as e:
        to_chat_request(req(**kw))
    assert e.value.status == 400 and e.value.param == param, (e.value.param, e.value.message)
    return e.value


def test_fields_map_to_chat():
    body = to_chat_request(req(system="Be brief.", temperature=0.2, top_p=0.9, top_k=4, stop_sequences=["\n\n"]))
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["top_k"]) == (8, 0.2, 0.9, 4)
    assert body["stop"] == ["\n\n"] and body["stream"] is False
    system_blocks = to_chat_request(req(system=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]))
    assert system_blocks["messages"][0] == {"role": "system", "content": "a\nb"}


def test_blocks_and_tool_history():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "weather "}, {"type": "text", "text": "in Paris?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "s"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "time", "input": {}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "noon"}]},
            {"type": "text", "text": "thanks"},
        ]},
    ]  # fmt: skip
    out = chat_messages(None, req(messages=messages).messages)
    assert out[0] == {"role": "user", "content": "weather in Paris?"}
    assert out[1]["role"] == "assistant" and out[1]["content"] == "Checking."
    assert out[1]["tool_calls"] == [
        {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
        {"id": "toolu_2", "type": "function", "function": {"name": "time", "arguments": "{}"}},
    ]
    assert out[2:] == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "noon"},
        {"role": "user", "content": "thanks"},
    ]


@pytest.mark.parametrize(
    "messages, param",
    [
        ([{"role": "system", "content": "x"}], "messages"),
        ([{"role": "user", "content": [{"type": "image", "source": {}}]}], "messages"),
        ([{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}], "messages"),
        ([{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": [1]}]}], "messages"),
        ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": 1, "content": "x"}]}], "messages"),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages"),
    ],
)
def test_bad_messages_are_400(messages, param):
    refused(param, messages=messages)


def test_tools_and_tool_choice():
    tools = [{"name": "weather", "description": "d", "input_schema": {"type": "object", "properties": {}}}]
    assert chat_tools(tools) == [
        {
            "type": "function",
            "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}, "description": "d"},
        }
    ]
    assert chat_tool_choice({"type": "auto"}) == {"tool_choice": "auto"}
    assert chat_tool_choice({"type": "any"}) == {"tool_choice": "required"}
    assert chat_tool_choice({"type": "none"}) == {"tool_choice": "none"}
    assert chat_tool_choice({"type": "tool", "name": "weather", "disable_parallel_tool_use": True}) == {
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
        "parallel_tool_calls": False,
    }
    body = to_chat_request(req(tools=tools, tool_choice={"type": "any"}))
    assert body["tools"][0]["function"]["name"] == "weather" and body["tool_choice"] == "required"
    refused("tools", tools=[{"type": "web_search_20250305", "name": "web_search"}])
    refused("tools", tools=[{"name": "f"}])  # no input_schema
    refused("tool_choice", tool_choice={"type": "sometimes"})
    refused("thinking", thinking={"type": "enabled", "budget_tokens": 1024})
    to_chat_request(req(thinking={"type": "disabled"}))


def test_errors_take_the_api_shape():
    assert error_body(bad_request("bad")) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "bad"},
    }
    kinds = {s: error_body(APIError(s, "m"))["error"]["type"] for s in (401, 404, 408, 413, 500, 503)}
    assert kinds == {
        401: "authentication_error",
        404: "not_found_error",
        408: "invalid_request_error",
        413: "request_too_large",
        500: "api_error",
        503: "overloaded_error",
    }
    anthropic_types.ErrorResponse.model_validate(error_body(bad_request("bad")))
    e = rename_chat_error(bad_request("stop must be ...", "stop"))
    assert e.param == "stop_sequences" and e.message.startswith("stop_sequences")


def test_stop_reasons():
    assert stop_reason("stop", None, False) == ("end_turn", None)
    assert stop_reason("stop", 2, False) == ("end_turn", None)  # a stop token (EOS)
    assert stop_reason("stop", "END", False) == ("stop_sequence", "END")
    assert stop_reason("length", None, False) == ("max_tokens", None)
    assert stop_reason("tool_calls", None, True) == ("tool_use", None)
    assert stop_reason("stop", None, True) == ("tool_use", None)


def chat_body(message: dict, finish_reason: str, chat_stop=None) -> dict:
    choice = {"index": 0, "message": message, "finish_reason": finish_reason, "stop_reason": chat_stop}
    return {"choices": [choice], "usage": USAGE}


def test_whole_message():
    m = message_from_chat(chat_body({"role": "assistant", "content": "Hello"}, "stop", "lo"), "msg_1", "tiny")
    anthropic_types.Message.model_validate(m)
    assert m["content"] == [{"type": "text", "text": "Hello"}]
    assert (m["stop_reason"], m["stop_sequence"], m["id"], m["model"]) == ("stop_sequence", "lo", "msg_1", "tiny")
    # prompt tokens read from the prefix cache are counted apart, as this API does
    assert m["usage"] == {
        "input_tokens": 3,
        "output_tokens": 3,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 4,
    }
    calls = [{"id": "call_a", "type": "function", "function": {"name": "get", "arguments": '{"x": 1}'}}]
    t = message_from_chat(
        chat_body({"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"), "m", "t"
    )
    anthropic_types.Message.model_validate(t)
    assert t["content"] == [{"type": "tool_use", "id": "call_a", "name": "get", "input": {"x": 1}}]
    assert t["stop_reason"] == "tool_use"
    # arguments that are not a JSON object come back as the text they are, not as a made-up input
    bad = [{"id": "c", "type": "function", "function": {"name": "get", "arguments": "[1"}}]
    assert content_blocks({"content": "", "tool_calls": bad}) == [{"type": "text", "text": "[1"}]
    assert content_blocks({"content": ""}) == [{"type": "text", "text": ""}]


def chunk(delta: dict, finish_reason: str | None = None, chat_stop=None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "stop_reason": chat_stop}]}


def call_delta(index: int, call_id: str | None = None, name: str | None = None, args: str | None = None) -> dict:
    """A chat stream chunk carrying one tool-call delta, as OpenAI's chat streams them."""
    fn = {k: v for k, v in (("name", name), ("arguments", args)) if v is not None}
    call = {"index": index, "function": fn, **({"id": call_id, "type": "function"} if call_id else {})}
    return chunk({"tool_calls": [call]})


def run_stream(chunks: list[dict]) -> list[dict]:
    tr = MessagesStream("msg_1", "tiny")
    events = tr.start(lambda: USAGE)
    assert events == []  # message_start waits for the first chunk, which knows the prompt's length
    for c in chunks:
        events += tr.feed(c)
    events += tr.finish(USAGE)
    for ev in events:
        if ev["type"] != "ping":
            EVENTS.validate_python(json.loads(json.dumps(ev)))
    return events


def test_stream_text():
    events = run_stream(
        [chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"}), chunk({"content": "lo"}, "stop")]
    )
    assert [ev["type"] for ev in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    start = events[0]["message"]
    assert start["id"] == "msg_1" and start["content"] == [] and start["usage"]["input_tokens"] == 3
    assert "".join(ev["delta"]["text"] for ev in events if ev["type"] == "content_block_delta") == "Hello"
    assert events[6]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[6]["usage"]["output_tokens"] == 3


def test_stream_empty_and_max_tokens():
    empty = run_stream([chunk({"role": "assistant", "content": ""}, "length")])
    assert [ev["type"] for ev in empty] == [
        "message_start", "ping", "content_block_start", "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    assert empty[4]["delta"]["stop_reason"] == "max_tokens"


def test_stream_tool_calls():
    chunks = [
        chunk({"role": "assistant", "content": "ok"}),
        call_delta(0, "call_a", "get", ""),
        call_delta(0, args='{"x"'),
        call_delta(0, args=": 1}"),
        call_delta(1, "call_b", "put", "{}"),
        chunk({}, "tool_calls"),
    ]
    events = run_stream(chunks)
    starts = [ev for ev in events if ev["type"] == "content_block_start"]
    assert [(ev["index"], ev["content_block"]["type"]) for ev in starts] == [
        (0, "text"),
        (1, "tool_use"),
        (2, "tool_use"),
    ]
    assert starts[1]["content_block"] == {"type": "tool_use", "id": "call_a", "name": "get", "input": {}}
    # blocks are sequential: each stops before the next starts
    order = [(ev["type"], ev.get("index")) for ev in events if ev["type"].startswith("content_block_")]
    for i in range(3):
        assert order.index(("content_block_stop", i)) < (
            order.index(("content_block_start", i + 1)) if i < 2 else len(order)
        )
    args = "".join(
        ev["delta"]["partial_json"] for ev in events if ev.get("index") == 1 and ev["type"] == "content_block_delta"
    )
    assert json.loads(args) == {"x": 1}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_stream_stop_sequence_and_failure():
    events = run_stream([chunk({"content": "a"}, "stop", "END")])
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    tr = MessagesStream("msg_1", "tiny")
    tr.start(lambda: USAGE)
    (err,) = tr.fail(APIError(500, "the engine failed", type="server_error"))
    assert err == {"type": "error", "error": {"type": "api_error", "message": "the engine failed"}}
