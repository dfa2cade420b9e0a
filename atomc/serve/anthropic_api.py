"""Anthropic's Messages API (`POST /v1/messages`), served through the chat pipeline.

A request becomes a chat-completions request: `system` a system message, `messages` chat messages
(`tool_use` blocks an assistant message's `tool_calls`, `tool_result` blocks `tool` messages), tools
(`{"name", "description", "input_schema"}`) chat function tools, `tool_choice` auto / any / tool /
none chat's auto / required / a function / none, `stop_sequences` chat's `stop`, `max_tokens` (which
this API requires) chat's `max_tokens`. The chat job runs it (translated_job.py), and its output
comes back as content blocks: the text a `text` block, each tool call a `tool_use` block; a stream's
chat chunks become `message_start`, `content_block_start` / `_delta` / `_stop`, `message_delta`,
`message_stop`. Errors have this API's shape, `{"type": "error", "error": {"type", "message"}}`
(`error_body`). Everything here is a pure function of dicts, tested without a server.

Served: text and tools, streaming or not. Refused with 400: image and document blocks, server tools,
extended thinking (the engine has no reasoning budget). `thinking` blocks in the history are dropped.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from atomc.serve.api_errors import APIError, bad_request

# chat's names for the fields an error can name -> this API's
CHAT_PARAMS = {"stop": "stop_sequences"}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def error_body(e: APIError) -> dict:
    """An APIError in Anthropic's error shape; other 4xx are `invalid_request_error`, as that API does."""
    kind = _ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict[str, Any]]


class AnthropicMessagesRequest(BaseModel):
    """The request body; content blocks stay dicts and are checked by the translation (clear 400s)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    max_tokens: int
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


# ---------------------------------------------------------------- request -> chat


def to_chat_request(req: AnthropicMessagesRequest) -> dict:
    """The chat-completions request body that answers `req` (checked by chat's own model next)."""
    if req.thinking and req.thinking.get("type") != "disabled":
        raise bad_request("extended thinking is not supported by this server", "thinking")
    body: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req.system, req.messages),
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "stop": req.stop_sequences,
        "stream": bool(req.stream),
    }
    if req.tools:
        body["tools"] = chat_tools(req.tools)
    if req.tool_choice is not None:
        body.update(chat_tool_choice(req.tool_choice))
    return body


def _text(value: Any, where: str, param: str = "messages") -> str:
    if not isinstance(value, str):
        raise bad_request(f"{where} must be a string", param)
    return value


def _text_blocks(blocks: Any, where: str, param: str) -> str:
    """Text blocks (a system prompt, a tool result's content) as one string; others are a 400."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad_request(f"{where} must be a string or a list of text blocks", param)
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else None
            raise bad_request(f"{where}[{j}]: only text blocks are supported (got type {kind!r})", param)
        texts.append(_text(block.get("text"), f"{where}[{j}].text", param))
    return "\n".join(texts)


def chat_messages(system: str | list[dict] | None, messages: list[AnthropicMessage]) -> list[dict]:
    """`system` + `messages` as chat messages, blocks kept in order: text runs become a message,
    each `tool_result` a `tool` message, an assistant's `tool_use` blocks its `tool_calls`."""
    out: list[dict] = []
    if system:
        out.append({"role": "system", "content": _text_blocks(system, "system", "system")})
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be user or assistant (the system prompt is `system`)", "messages")
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        out += _block_messages(m.role, m.content, where)
    return out


def _block_messages(role: str, blocks: list[dict], where: str) -> list[dict]:
    """One message's blocks as chat messages, in order (a user turn's tool results come first)."""
    out: list[dict] = []
    texts: list[str] = []
    calls: list[dict] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block.get("type")
        if kind == "text":
            texts.append(_text(block.get("text"), f"{at}.text"))
        elif kind == "tool_use" and role == "assistant":
            calls.append(chat_tool_call(block, at))
        elif kind == "tool_result" and role == "user":
            out += _joined(role, texts, calls)
            texts, calls = [], []
            call_id = _text(block.get("tool_use_id"), f"{at}.tool_use_id")
            content = _text_blocks(block.get("content", ""), f"{at}.content", "messages")
            out.append({"role": "tool", "tool_call_id": call_id, "content": content})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            message = f"{at}: content block type {kind!r} is not supported in a {role} message"
            raise bad_request(message, "messages")
    return out + _joined(role, texts, calls)


def _joined(role: str, texts: list[str], calls: list[dict]) -> list[dict]:
    if not texts and not calls:
        return []
    msg: dict[str, Any] = {"role": role, "content": "".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    return [msg]


def chat_tool_call(block: dict, where: str) -> dict:
    """A `tool_use` block as a chat tool call (arguments: the input as a JSON string)."""
    tool_input = block.get("input", {})
    if not isinstance(tool_input, dict):
        raise bad_request(f"{where}.input must be an object", "messages")
    return {
        "id": _text(block.get("id"), f"{where}.id"),
        "type": "function",
        "function": {"name": _text(block.get("name"), f"{where}.name"), "arguments": json.dumps(tool_input)},
    }


def chat_tools(tools: list[dict]) -> list[dict]:
    """Client tools as chat function tools; server tools (a `type` other than custom) are a 400."""
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom"):
            raise bad_request(
                f"tools[{i}]: tool type {tool.get('type')!r} is not supported; only client tools are", "tools"
            )
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise bad_request(f"tools[{i}].input_schema must be a JSON schema object", "tools")
        fn: dict[str, Any] = {"name": _text(tool.get("name"), f"tools[{i}].name", "tools"), "parameters": schema}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: dict) -> dict:
    """`tool_choice` as chat's `tool_choice` (+ `parallel_tool_calls` for disable_parallel_tool_use)."""
    kind = choice.get("type")
    if kind == "auto":
        out: dict[str, Any] = {"tool_choice": "auto"}
    elif kind == "any":
        out = {"tool_choice": "required"}
    elif kind == "none":
        out = {"tool_choice": "none"}
    elif kind == "tool":
        name = _text(choice.get("name"), "tool_choice.name", "tool_choice")
        out = {"tool_choice": {"type": "function", "function": {"name": name}}}
    else:
        raise bad_request(f"tool_choice type must be auto, any, tool or none, got {kind!r}", "tool_choice")
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def rename_chat_error(e: APIError) -> APIError:
    if e.param in CHAT_PARAMS:
        name = CHAT_PARAMS[e.param]
        if e.message.startswith(e.param):
            e.message = name + e.message[len(e.param) :]
        e.param = name
    return e


# ---------------------------------------------------------------- chat output -> Messages


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def anthropic_usage(chat_usage: dict) -> dict:
    """This API counts prompt tokens read from the cache apart from `input_tokens`."""
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"] - cached,
        "output_tokens": chat_usage["completion_tokens"],
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def stop_reason(finish_reason: str | None, chat_stop_reason: Any, called_tools: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence): a matched stop string is chat's `stop_reason` when it is a str
    (an int is a stop token, EOS included: the model's own end of turn)."""
    if called_tools or finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "stop" and isinstance(chat_stop_reason, str):
        return "stop_sequence", chat_stop_reason
    return ("end_turn", None) if finish_reason is not None else (None, None)


def tool_use_block(call: dict) -> dict:
    """A chat tool call as a `tool_use` block; its arguments must be a JSON object (the chat
    parser's output is), else the call is returned as text rather than a made-up input."""
    fn = call.get("function") or {}
    try:
        tool_input = json.loads(fn.get("arguments") or "{}")
    except ValueError:
        tool_input = None
    if not isinstance(tool_input, dict):
        return {"type": "text", "text": fn.get("arguments") or ""}
    return {
        "type": "tool_use",
        "id": call.get("id") or new_id("toolu"),
        "name": fn.get("name") or "",
        "input": tool_input,
    }


def content_blocks(message: dict) -> list[dict]:
    """A chat message as content blocks: the text (also when empty and no tool was called), then
    one tool_use block per tool call."""
    text, calls = message.get("content") or "", message.get("tool_calls") or []
    blocks = [{"type": "text", "text": text}] if text or not calls else []
    return blocks + [tool_use_block(c) for c in calls]


def message_from_chat(chat_body: dict, msg_id: str, model: str) -> dict:
    (choice,) = chat_body["choices"]
    message = choice["message"]
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"), bool(message.get("tool_calls")))
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(message),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": anthropic_usage(chat_body["usage"]),
    }


class MessagesStream:
    """Chat chunks -> Messages stream events. `message_start` goes out with the first chunk (the
    prompt's token count is known then); text opens a text block, each new chat tool-call index a
    tool_use block whose arguments stream as `input_json_delta`; a block closes when the next one
    opens (arguments of an already closed call, which chat parsers do not send, still go to its
    index: the clients accumulate by index)."""

    def __init__(self, msg_id: str, model: str):
        self.msg_id, self.model = msg_id, model
        self.started = False
        self.blocks = 0  # blocks opened so far
        self.open: int | None = None  # index of the open block
        self.text_open = False
        self.calls: dict[int, int] = {}  # chat tool-call index -> block index
        self.finish_reason: str | None = None
        self.chat_stop_reason: Any = None
        self._usage: Callable[[], dict] | None = None

    def start(self, chat_usage: Callable[[], dict]) -> list[dict]:
        self._usage = chat_usage
        return []

    def _start(self) -> list[dict]:
        if self.started:
            return []
        self.started = True
        usage = anthropic_usage(self._usage()) if self._usage else anthropic_usage(_NO_USAGE)
        usage["output_tokens"] = 0
        message = {
            "id": self.msg_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _open(self, block: dict) -> list[dict]:
        events = self._close()
        self.open = self.blocks
        self.blocks += 1
        return events + [{"type": "content_block_start", "index": self.open, "content_block": block}]

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        index, self.open, self.text_open = self.open, None, False
        return [{"type": "content_block_stop", "index": index}]

    def feed(self, chunk: dict) -> list[dict]:
        events = self._start()
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            text = delta.get("content")
            if text:
                if not self.text_open:
                    events += self._open({"type": "text", "text": ""})
                    self.text_open = True
                events.append(
                    {"type": "content_block_delta", "index": self.open, "delta": {"type": "text_delta", "text": text}}
                )
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason, self.chat_stop_reason = choice["finish_reason"], choice.get("stop_reason")
        return events

    def _call(self, call: dict) -> list[dict]:
        index = call.get("index", 0)
        fn = call.get("function") or {}
        events = []
        if index not in self.calls:
            block = {
                "type": "tool_use",
                "id": call.get("id") or new_id("toolu"),
                "name": fn.get("name") or "",
                "input": {},
            }
            events += self._open(block)
            self.calls[index] = self.open  # type: ignore[assignment]
        if fn.get("arguments"):
            delta = {"type": "input_json_delta", "partial_json": fn["arguments"]}
            events.append({"type": "content_block_delta", "index": self.calls[index], "delta": delta})
        return events

    def finish(self, chat_usage: dict) -> list[dict]:
        events = self._start()
        if self.blocks == 0:  # nothing generated: still one (empty) text block, as a whole message has
            events += self._open({"type": "text", "text": ""})
        events += self._close()
        reason, sequence = stop_reason(self.finish_reason, self.chat_stop_reason, bool(self.calls))
        usage = anthropic_usage(chat_usage)
        events.append(
            {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": usage}
        )
        return events + [{"type": "message_stop"}]

    def fail(self, error: APIError) -> list[dict]:
        return [error_body(error)]


_NO_USAGE = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
