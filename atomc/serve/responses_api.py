"""OpenAI's Responses API (`POST /v1/responses`), served through the chat pipeline.

A request becomes a chat-completions request: `instructions` a system message, `input` (a string,
or items) chat messages, `function_call` / `function_call_output` items an assistant message's
`tool_calls` and `tool` messages, function tools chat tools, `text.format` chat's `response_format`,
`max_output_tokens` `max_tokens`. The chat job runs it (translated_job.py), and its output comes back
as Responses output items: the text a `message` item, each chat tool call a `function_call` item; a
stream's chat chunks become Responses' semantic events (`response.created` ... `response.completed`,
no `[DONE]`). Everything here is a pure function of dicts, so it is tested without a server.

Stateless on purpose: atomc keeps no responses, so `store: true`, `previous_response_id`,
`conversation`, `background: true` and the other fields that need a stored response (or features
the engine lacks: reasoning, logprobs, truncation) are refused with 400 rather than ignored; a
client passes the whole conversation in `input`, as with `store: false`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from atomc.serve.api_errors import APIError, bad_request

# vLLM's extra sampling fields, passed to chat unchanged (the Responses API itself has none of them)
SAMPLING_EXTRAS = (
    "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop",
    "stop_token_ids", "ignore_eos", "min_tokens", "skip_special_tokens", "include_stop_str_in_output",
)  # fmt: skip
# chat's names for the fields an error can name -> this API's
CHAT_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


class ResponsesRequest(BaseModel):
    """The request body; item lists stay dicts and are checked by the translation (clear 400s)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool | None = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    # need stored responses or engine features atomc lacks: refused unless off (see refuse_unserved)
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None
    # SAMPLING_EXTRAS
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None


# ---------------------------------------------------------------- request -> chat


def refuse_unserved(req: ResponsesRequest) -> None:
    """400 for the stateful fields and the features atomc does not serve, when asked for."""
    no_store = "atomc keeps no responses; pass the whole conversation in input"
    if req.store:
        raise bad_request(f"store: true is not supported: {no_store} (send store: false or leave it out)", "store")
    if req.previous_response_id is not None:
        raise bad_request(f"previous_response_id is not supported: {no_store}", "previous_response_id")
    if req.conversation is not None:
        raise bad_request(f"conversation is not supported: {no_store}", "conversation")
    if req.background:
        raise bad_request(
            "background mode is not supported: it needs stored responses; use stream instead", "background"
        )
    if req.prompt is not None:
        raise bad_request("prompt templates are not supported; send the instructions and input", "prompt")
    if req.include:
        raise bad_request(f"include is not supported (got {req.include[:3]})", "include")
    if req.reasoning and any(v is not None for v in req.reasoning.values()):
        raise bad_request("reasoning options are not supported by this server", "reasoning")
    if req.truncation not in (None, "disabled"):
        raise bad_request("only truncation 'disabled' is supported: a too-long input is a 400", "truncation")
    if req.top_logprobs:
        raise bad_request("top_logprobs is not supported on /v1/responses; use /v1/chat/completions", "top_logprobs")
    if req.max_tool_calls is not None:
        raise bad_request("max_tool_calls is not supported", "max_tool_calls")


def to_chat_request(req: ResponsesRequest) -> dict:
    """The chat-completions request body that answers `req` (checked by chat's own model next)."""
    refuse_unserved(req)
    body: dict[str, Any] = {
        "model": req.model,
        "messages": input_messages(req.input, req.instructions),
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": bool(req.stream),
    }
    for name in SAMPLING_EXTRAS:
        value = getattr(req, name)
        if value is not None:
            body[name] = value
    if req.tools:
        body["tools"] = chat_tools(req.tools)
    if req.tool_choice is not None:
        body["tool_choice"] = chat_tool_choice(req.tool_choice)
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    fmt = chat_response_format(req.text)
    if fmt is not None:
        body["response_format"] = fmt
    return body


def _text(value: Any, where: str, param: str = "input") -> str:
    if not isinstance(value, str):
        raise bad_request(f"{where} must be a string", param)
    return value


_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def _content_text(content: Any, where: str) -> str:
    """A message's content (a string, or text parts) as one string; non-text parts are a 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str) or kind not in _TEXT_PARTS:
            raise bad_request(f"{where}.content[{j}]: only text content is supported (got type {kind!r})", "input")
        texts.append(_text(part.get(_TEXT_PARTS[kind]), f"{where}.content[{j}].{_TEXT_PARTS[kind]}"))
    return "".join(texts)


def input_messages(input: str | list[dict], instructions: str | None) -> list[dict]:
    """`instructions` + `input` as chat messages. A run of `function_call` items joins the assistant
    message before it (one turn with parallel calls); `reasoning` items are dropped (no reasoning
    is served, and their text is the model's own scratch work)."""
    messages: list[dict] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(input, str):
        return messages + [{"role": "user", "content": input}]
    for i, item in enumerate(input):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            role = _ROLES.get(role) if isinstance(role, str) else None
            if role is None:
                raise bad_request(f"{where}.role must be one of {sorted(_ROLES)}, got {item.get('role')!r}", "input")
            messages.append({"role": role, "content": _content_text(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": _text(item.get("call_id"), f"{where}.call_id"),
                "type": "function",
                "function": {
                    "name": _text(item.get("name"), f"{where}.name"),
                    "arguments": _text(item.get("arguments"), f"{where}.arguments"),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _content_text(output, f"{where}.output")
            messages.append(
                {"role": "tool", "tool_call_id": _text(item.get("call_id"), f"{where}.call_id"), "content": text}
            )
        elif kind == "reasoning":
            continue
        elif kind == "item_reference":
            raise bad_request(f"{where}: item_reference needs stored responses, which atomc does not keep", "input")
        else:
            raise bad_request(f"{where}: input item type {kind!r} is not supported", "input")
    return messages


def chat_tools(tools: list[dict]) -> list[dict]:
    """Responses function tools (`{"type": "function", "name", "description", "parameters",
    "strict"}`) as chat tools (`{"type": "function", "function": {...}}`); built-in tools are a 400."""
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(
                f"tools[{i}]: tool type {tool.get('type')!r} is not supported; only function tools are", "tools"
            )
        fn: dict[str, Any] = {"name": _text(tool.get("name"), f"tools[{i}].name", "tools")}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                fn[key] = tool[key]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise bad_request(f"tool_choice must be auto, none, required or a function, got {choice!r}", "tool_choice")
        return choice
    if choice.get("type") == "function":
        return {"type": "function", "function": {"name": _text(choice.get("name"), "tool_choice.name", "tool_choice")}}
    raise bad_request(f"tool_choice type {choice.get('type')!r} is not supported", "tool_choice")


def chat_response_format(text: dict | None) -> dict | None:
    """`text.format` as chat's `response_format`; None for plain text."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise bad_request(f"text.format type {kind!r} is not supported", "text.format")


def rename_chat_error(e: APIError) -> APIError:
    """A chat-side 400 about the translated request, naming this API's field instead of chat's."""
    if e.param in CHAT_PARAMS:
        name = CHAT_PARAMS[e.param]
        if e.message.startswith(e.param):
            e.message = name + e.message[len(e.param) :]
        e.param = name
    return e


# ---------------------------------------------------------------- chat output -> Responses


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_usage(chat_usage: dict | None) -> dict | None:
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def message_item(item_id: str, text: str, status: str) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": [part]}


def function_call_item(item_id: str, call: dict, status: str) -> dict:
    """A chat tool call (`{"id", "type", "function": {"name", "arguments"}}`) as a function_call item."""
    fn = call.get("function") or {}
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call.get("id") or new_id("call"),
        "name": fn.get("name") or "",
        "arguments": fn.get("arguments") or "",
    }


def output_items(message: dict, finish_reason: str | None) -> list[dict]:
    """A chat message as output items: its text as a message item (also when empty and no tool was
    called, so there is always one item), then one function_call item per tool call."""
    status = _status(finish_reason)
    text, calls = message.get("content") or "", message.get("tool_calls") or []
    items = [message_item(new_id("msg"), text, status)] if text or not calls else []
    return items + [function_call_item(new_id("fc"), call, status) for call in calls]


class ResponseShell:
    """The response object's fields that echo the request; `build` fills in the rest."""

    def __init__(self, req: ResponsesRequest, model: str):
        self.req, self.model = req, model
        self.id, self.created_at = new_id("resp"), int(time.time())

    def build(self, status: str, output: list[dict], usage: dict | None, error: dict | None = None) -> dict:
        req = self.req
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": req.temperature,
            "text": req.text if req.text and req.text.get("format") else {"format": {"type": "text"}},
            "tool_choice": "auto" if req.tool_choice is None else req.tool_choice,
            "tools": req.tools or [],
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
            "metadata": req.metadata or {},
        }

    def from_chat(self, chat_body: dict) -> dict:
        """A whole chat completion (one choice) as the response object."""
        (choice,) = chat_body["choices"]
        items = output_items(choice["message"], choice["finish_reason"])
        return self.build(_status(choice["finish_reason"]), items, responses_usage(chat_body.get("usage")))


class ResponsesStream:
    """Chat chunks -> Responses stream events. Text opens a message item on its first character;
    each new chat tool-call index opens a function_call item (closing the text item before it);
    items close at the end, in order, then `response.completed` (or `.incomplete` when
    max_output_tokens cut it) carries the whole response."""

    def __init__(self, shell: ResponseShell):
        self.shell = shell
        self.seq = 0
        self.output: list[dict] = []  # items as they stand (the final response's output)
        self.text_at: int | None = None  # output index of the open message item
        self.calls: dict[int, int] = {}  # chat tool-call index -> output index
        self.open_calls: list[int] = []
        self.finish_reason: str | None = None

    def _ev(self, kind: str, **fields) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start(self, chat_usage: Callable[[], dict]) -> list[dict]:
        snapshot = self.shell.build("in_progress", [], None)
        return [self._ev("response.created", response=snapshot), self._ev("response.in_progress", response=snapshot)]

    def feed(self, chunk: dict) -> list[dict]:
        events: list[dict] = []
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return events

    def _open_text(self) -> list[dict]:
        at = self.text_at = len(self.output)
        item = message_item(new_id("msg"), "", "in_progress")
        self.output.append(item)
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self._ev("response.output_item.added", output_index=at, item={**item, "content": []}),
            self._ev("response.content_part.added", **self._where(at), part=part),
        ]

    def _text(self, delta: str) -> list[dict]:
        events = self._open_text() if self.text_at is None else []
        at = self.text_at
        assert at is not None
        self.output[at]["content"][0]["text"] += delta
        events.append(self._ev("response.output_text.delta", **self._where(at), delta=delta, logprobs=[]))
        return events

    def _where(self, index: int, content: bool = True) -> dict:
        where = {"item_id": self.output[index]["id"], "output_index": index}
        return {**where, "content_index": 0} if content else where

    def _close_text(self, status: str) -> list[dict]:
        if self.text_at is None:
            return []
        at, self.text_at = self.text_at, None
        item = self.output[at]
        item["status"] = status
        part = item["content"][0]
        return [
            self._ev("response.output_text.done", **self._where(at), text=part["text"], logprobs=[]),
            self._ev("response.content_part.done", **self._where(at), part=part),
            self._ev("response.output_item.done", output_index=at, item=item),
        ]

    def _call(self, call: dict) -> list[dict]:
        index = call.get("index", 0)
        fn = call.get("function") or {}
        events = []
        if index not in self.calls:
            events += self._close_text("completed")
            at = self.calls[index] = len(self.output)
            self.open_calls.append(at)
            item = function_call_item(
                new_id("fc"), {"id": call.get("id"), "function": {"name": fn.get("name")}}, "in_progress"
            )
            self.output.append(item)
            events.append(self._ev("response.output_item.added", output_index=at, item=dict(item)))
        at = self.calls[index]
        if fn.get("arguments"):
            self.output[at]["arguments"] += fn["arguments"]
            events.append(
                self._ev("response.function_call_arguments.delta", **self._where(at, False), delta=fn["arguments"])
            )
        return events

    def finish(self, chat_usage: dict) -> list[dict]:
        status = _status(self.finish_reason)
        events = []
        if not self.output:  # nothing generated: still one (empty) message item, as a whole response has
            events += self._open_text()
        events += self._close_text(status)
        for at in self.open_calls:
            item = self.output[at]
            item["status"] = status
            events.append(
                self._ev(
                    "response.function_call_arguments.done",
                    **self._where(at, False),
                    arguments=item["arguments"],
                    name=item["name"],
                )
            )
            events.append(self._ev("response.output_item.done", output_index=at, item=item))
        self.open_calls = []
        final = self.shell.build(status, self.output, responses_usage(chat_usage))
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return events + [self._ev(kind, response=final)]

    def fail(self, error: APIError) -> list[dict]:
        err = {"code": "server_error", "message": error.message}
        return [self._ev("response.failed", response=self.shell.build("failed", self.output, None, error=err))]
