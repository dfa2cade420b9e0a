"""The Responses API translation, without a server: requests into chat-completions bodies, chat
output (whole and streamed, text and tool calls) into Responses objects and events. Shapes are
checked against the official openai SDK's own types, so a field we misname fails here."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from atomc.serve.api_errors import APIError, bad_request
from atomc.serve.responses_api import (
    ResponseShell,
    ResponsesRequest,
    ResponsesStream,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    input_messages,
    output_items,
    rename_chat_error,
    to_chat_request,
)

EVENTS = TypeAdapter(ResponseStreamEvent)
USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4}}


def req(**kw) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "hi", **kw})


def refused(param: str, **kw) -> APIError:
    with pytest.raises(APIError) as e:
        to_chat_request(req(**kw))
    assert e.value.status == 400 and e.value.param == param, (e.value.param, e.value.message)
    return e.value


# ---------------------------------------------------------------- request -> chat


def test_string_input_and_instructions():
    body = to_chat_request(req(input="Hello", instructions="Be brief.", max_output_tokens=5, temperature=0.5))
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert body["max_tokens"] == 5 and body["temperature"] == 0.5 and body["stream"] is False
    assert "tools" not in body and "response_format" not in body


def test_items_with_parts_roles_and_tool_history():
    items = [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": t} for t in "ab"]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me look"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get", "arguments": '{"x": 1}'},
        {"type": "function_call", "call_id": "call_2", "name": "put", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "ok"}]},
    ]  # fmt: skip
    msgs = input_messages(items, None)
    assert msgs[0] == {"role": "system", "content": "rules"}
    assert msgs[1] == {"role": "user", "content": "ab"}
    # the calls join the assistant turn before them (parallel calls of one turn); reasoning is dropped
    assert msgs[2]["role"] == "assistant" and msgs[2]["content"] == "let me look"
    assert [c["id"] for c in msgs[2]["tool_calls"]] == ["call_1", "call_2"]
    assert msgs[2]["tool_calls"][0] == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get", "arguments": '{"x": 1}'},
    }
    assert msgs[3:] == [
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        {"role": "tool", "tool_call_id": "call_2", "content": "ok"},
    ]
    # a call with no assistant text before it gets its own assistant message
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    lone = input_messages([{"role": "user", "content": "q"}, call], None)
    chat_call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert lone[1] == {"role": "assistant", "content": "", "tool_calls": [chat_call]}


@pytest.mark.parametrize(
    "items, needle",
    [
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "only text"),
        ([{"role": "tool", "content": "x"}], "role"),
        ([{"type": "item_reference", "id": "msg_1"}], "stored"),
        ([{"type": "web_search_call"}], "not supported"),
        ([{"type": "function_call", "call_id": 3, "name": "f", "arguments": "{}"}], "call_id"),
        ([{"role": "user", "content": 5}], "content"),
        ([{"role": ["user"], "content": "x"}], "role"),  # unhashable values found by the fuzz test
        ([{"role": "user", "content": [{"type": ["input_text"], "text": "x"}]}], "only text"),
    ],
)
def test_bad_items_are_400_on_input(items, needle):
    err = refused("input", input=items)
    assert needle in err.message


def test_tools_tool_choice_and_format():
    tools = [{"type": "function", "name": "get", "description": "d", "parameters": {"type": "object"}, "strict": True}]
    assert chat_tools(tools) == [
        {
            "type": "function",
            "function": {"name": "get", "description": "d", "parameters": {"type": "object"}, "strict": True},
        }
    ]
    assert chat_tool_choice("required") == "required"
    assert chat_tool_choice({"type": "function", "name": "get"}) == {"type": "function", "function": {"name": "get"}}
    body = to_chat_request(req(tools=tools, tool_choice="auto", parallel_tool_calls=False))
    assert body["tools"][0]["function"]["name"] == "get" and body["tool_choice"] == "auto"
    assert body["parallel_tool_calls"] is False
    assert "web_search" in refused("tools", tools=[{"type": "web_search"}]).message
    refused("tool_choice", tool_choice="sometimes")
    refused("tool_choice", tool_choice={"type": "allowed_tools", "tools": []})
    schema = {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}
    assert chat_response_format({"format": schema}) == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True},
    }
    assert chat_response_format({"format": {"type": "text"}}) is None
    assert chat_response_format({"format": {"type": "json_object"}}) == {"type": "json_object"}
    refused("text.format", text={"format": {"type": "yaml"}})


@pytest.mark.parametrize(
    "field, value",
    [
        ("store", True),
        ("previous_response_id", "resp_1"),
        ("conversation", "conv_1"),
        ("background", True),
        ("prompt", {"id": "pmpt_1"}),
        ("include", ["message.output_text.logprobs"]),
        ("reasoning", {"effort": "high"}),
        ("truncation", "auto"),
        ("top_logprobs", 3),
        ("max_tool_calls", 2),
    ],
)
def test_unserved_fields_are_refused(field, value):
    refused(field, **{field: value})


def test_unserved_fields_off_are_fine():
    to_chat_request(req(store=False, background=False, include=[], reasoning={}, truncation="disabled", top_logprobs=0))


def test_sampling_extras_pass_through_and_chat_errors_are_renamed():
    body = to_chat_request(req(top_k=5, seed=3, stop=["\n"], ignore_eos=True))
    assert (body["top_k"], body["seed"], body["stop"], body["ignore_eos"]) == (5, 3, ["\n"], True)
    e = rename_chat_error(bad_request("max_tokens must be at least 1, got 0", "max_tokens"))
    assert e.param == "max_output_tokens" and e.message.startswith("max_output_tokens must")
    assert rename_chat_error(bad_request("x", "messages")).param == "input"
    assert rename_chat_error(bad_request("x", "response_format")).param == "text.format"


# ---------------------------------------------------------------- chat output -> Responses


def chat_body(message: dict, finish_reason: str) -> dict:
    return {"choices": [{"index": 0, "message": message, "finish_reason": finish_reason}], "usage": USAGE}


def test_whole_response_text():
    shell = ResponseShell(req(max_output_tokens=3, metadata={"k": "v"}), "tiny")
    r = shell.from_chat(chat_body({"role": "assistant", "content": "Hello"}, "stop"))
    parsed = Response.model_validate(r)
    assert parsed.output_text == "Hello" and parsed.status == "completed" and parsed.model == "tiny"
    assert r["id"].startswith("resp_") and r["store"] is False and r["metadata"] == {"k": "v"}
    assert r["usage"] == {
        "input_tokens": 7,
        "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 10,
    }
    cut = shell.from_chat(chat_body({"role": "assistant", "content": "Hel"}, "length"))
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["output"][0]["status"] == "incomplete"
    empty = shell.from_chat(chat_body({"role": "assistant", "content": ""}, "stop"))
    assert [i["type"] for i in empty["output"]] == ["message"]  # always one item


def test_whole_response_tool_calls():
    calls = [
        {"id": "call_a", "type": "function", "function": {"name": "get", "arguments": '{"x": 1}'}},
        {"id": "call_b", "type": "function", "function": {"name": "put", "arguments": "{}"}},
    ]
    items = output_items({"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls")
    assert [(i["type"], i["call_id"], i["name"], i["arguments"]) for i in items] == [
        ("function_call", "call_a", "get", '{"x": 1}'),
        ("function_call", "call_b", "put", "{}"),
    ]
    assert all(i["id"].startswith("fc_") and i["status"] == "completed" for i in items)
    with_text = output_items({"role": "assistant", "content": "sure", "tool_calls": calls[:1]}, "tool_calls")
    assert [i["type"] for i in with_text] == ["message", "function_call"]
    r = ResponseShell(req(), "tiny").from_chat(
        chat_body({"role": "assistant", "content": "sure", "tool_calls": calls}, "tool_calls")
    )
    Response.model_validate(r)


def chunk(delta: dict, finish_reason: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}


def call_delta(index: int, call_id: str | None = None, name: str | None = None, args: str | None = None) -> dict:
    """A chat stream chunk carrying one tool-call delta, as OpenAI's chat streams them."""
    fn = {k: v for k, v in (("name", name), ("arguments", args)) if v is not None}
    call = {"index": index, "function": fn, **({"id": call_id, "type": "function"} if call_id else {})}
    return chunk({"tool_calls": [call]})


def run_stream(chunks: list[dict], **kw) -> list[dict]:
    tr = ResponsesStream(ResponseShell(req(**kw), "tiny"))
    events = tr.start(lambda: USAGE)
    for c in chunks:
        events += tr.feed(c)
    events += tr.finish(USAGE)
    for ev in events:  # every event parses as the SDK's own type, and survives JSON
        EVENTS.validate_python(json.loads(json.dumps(ev)))
    assert [ev["sequence_number"] for ev in events] == list(range(len(events)))
    return events


def test_stream_text():
    events = run_stream(
        [chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"}), chunk({"content": "lo"}, "stop")]
    )
    types = [ev["type"] for ev in events]
    assert types == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert "".join(ev["delta"] for ev in events if ev["type"] == "response.output_text.delta") == "Hello"
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == "Hello" and final.usage.output_tokens == 3
    item_id = events[2]["item"]["id"]
    assert all(ev["item_id"] == item_id for ev in events[3:9] if "item_id" in ev)


def test_stream_cut_by_max_output_tokens_and_empty():
    events = run_stream([chunk({"content": "Hel"}, "length")])
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    empty = run_stream([chunk({"role": "assistant", "content": ""}, "stop")])
    assert [ev["type"] for ev in empty][2:] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip


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
    types = [ev["type"] for ev in events]
    # the text item closes before the first call opens
    assert types.index("response.output_item.done") < types.index("response.function_call_arguments.delta")
    added = [ev["item"] for ev in events if ev["type"] == "response.output_item.added"]
    assert [(i["type"], i.get("call_id"), i.get("name")) for i in added] == [
        ("message", None, None),
        ("function_call", "call_a", "get"),
        ("function_call", "call_b", "put"),
    ]
    done = {ev["output_index"]: ev for ev in events if ev["type"] == "response.function_call_arguments.done"}
    assert done[1]["arguments"] == '{"x": 1}' and done[2]["arguments"] == "{}" and done[1]["name"] == "get"
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call", "function_call"]
    assert final["output"][1]["arguments"] == '{"x": 1}' and final["output"][1]["status"] == "completed"


def test_stream_failure():
    tr = ResponsesStream(ResponseShell(req(), "tiny"))
    events = tr.start(lambda: USAGE) + tr.feed(chunk({"content": "a"}))
    (failed,) = tr.fail(APIError(500, "the engine failed", type="server_error"))
    EVENTS.validate_python(failed)
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": "the engine failed"}
    assert failed["sequence_number"] == len(events)
