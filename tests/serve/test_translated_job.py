"""TranslatedJob over a stand-in chat job that streams tool calls as OpenAI's chat API does (what
chat's tool-call parser emits once it is merged): the SSE text each API's client reads, parsed back
and checked against the SDKs' event types, and the whole-response path with the same calls."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from atomc.serve.anthropic_api import MessagesStream, message_from_chat
from atomc.serve.async_engine import RequestFailedError
from atomc.serve.responses_api import ResponseShell, ResponsesRequest, ResponsesStream
from atomc.serve.translated_job import TranslatedJob

anthropic_types = pytest.importorskip("anthropic.types")
USAGE = {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9, "prompt_tokens_details": {"cached_tokens": 0}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CHUNKS = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
    {
        "choices": [
            {
                "index": 0,
                "delta": {"tool_calls": [{"index": 0, **CALL, "function": {"name": "get_weather", "arguments": ""}}]},
                "finish_reason": None,
            }
        ]
    },  # noqa: E501
    {
        "choices": [
            {
                "index": 0,
                "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
                "finish_reason": None,
            }
        ]
    },  # noqa: E501
    {
        "choices": [
            {
                "index": 0,
                "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
                "finish_reason": None,
            }
        ]
    },  # noqa: E501
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
]
BODY = {
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": None, "tool_calls": [CALL]},
            "finish_reason": "tool_calls",
        }
    ],
    "usage": USAGE,
}


class FakeChat:
    """What TranslatedJob uses of a ChatJob."""

    def __init__(self, fail: bool = False):
        self.fail, self.closed = fail, False

    async def chunks(self):
        for c in CHUNKS[:2] if self.fail else CHUNKS:
            yield c
        if self.fail:
            raise RequestFailedError("step raised")

    async def body(self):
        return BODY

    def usage(self):
        return USAGE

    def close(self):
        self.closed = True


def collect(job: TranslatedJob) -> list[tuple[str, dict]]:
    async def run():
        return [ev async for ev in job.events()]

    out = []
    for raw in asyncio.run(run()):
        name, data = raw.rstrip("\n").split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def responses_job(fail: bool = False) -> TranslatedJob:
    shell = ResponseShell(ResponsesRequest(input="hi", stream=True), "tiny")
    return TranslatedJob(FakeChat(fail), shell.req, shell.from_chat, lambda: ResponsesStream(shell))


def messages_job(fail: bool = False) -> TranslatedJob:
    req = type("Req", (), {"stream": True})()
    whole = lambda body: message_from_chat(body, "msg_1", "tiny")  # noqa: E731
    return TranslatedJob(FakeChat(fail), req, whole, lambda: MessagesStream("msg_1", "tiny"))


def test_responses_tool_call_stream():
    events = collect(responses_job())
    adapter = TypeAdapter(ResponseStreamEvent)
    for name, data in events:
        assert name == data["type"]
        adapter.validate_python(data)
    args = "".join(d["delta"] for n, d in events if n == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}
    final = Response.model_validate(events[-1][1]["response"])
    (item,) = final.output  # no empty text item beside the call
    assert (item.type, item.call_id, item.name, item.arguments) == ("function_call", "call_1", "get_weather", args)
    whole = json.loads(asyncio.run(responses_job().response()).body)
    assert [(i["type"], i["call_id"], i["arguments"]) for i in whole["output"]] == [("function_call", "call_1", args)]


def test_messages_tool_call_stream():
    events = collect(messages_job())
    adapter = TypeAdapter(anthropic_types.RawMessageStreamEvent)
    for name, data in events:
        assert name == data["type"]
        if name != "ping":
            adapter.validate_python(data)
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert starts == [{"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}]
    args = "".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta")
    assert json.loads(args) == {"city": "Paris"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use" and events[-1][0] == "message_stop"
    whole = json.loads(asyncio.run(messages_job().response()).body)
    assert whole["content"] == [{"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]
    assert whole["stop_reason"] == "tool_use"


def test_failure_mid_stream_ends_each_stream_in_band():
    r = collect(responses_job(fail=True))
    assert r[-1][0] == "response.failed" and r[-1][1]["response"]["output"][0]["type"] == "function_call"
    m = collect(messages_job(fail=True))
    assert m[0][0] == "message_start" and m[-1] == (
        "error",
        {"type": "error", "error": {"type": "api_error", "message": "step raised"}},
    )
