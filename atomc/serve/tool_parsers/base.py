"""What a tool-call parser is: cumulative model output in, content and tool-call drafts out.

A parser's `parse(text, token_ids, final)` reads the whole output so far (the content left after
the reasoning parser took its part) and returns the content outside tool calls and one
`CallDraft` per call begun. Streaming calls it after every step and sends the difference
(atomc/serve/chat_output.py), so a parser only says what the output means so far; it never tracks
what was sent. The contract that makes the differences valid deltas: while `final` is False, the
content and each call's arguments only ever grow at their end, and a call's name, once set, stays.
So a parser holds back a tail that might still turn into a marker, and reports a name only once
its whole string is in.

`extract` is the whole-output parse of a non-streaming response: the final parse, checked
(every call named, its arguments a JSON object); anything else falls back to the text as plain
content, so a malformed call is never an error.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass

from atomc.serve.tool_parsers.json_scan import ObjectScan, scan_object, skip_ws


@dataclass
class CallDraft:
    name: str | None  # None until the whole name is in
    arguments: str  # the raw JSON text of the arguments so far
    complete: bool = False


@dataclass
class ToolParse:
    content: str
    calls: list[CallDraft]


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolParser:
    """Base of the format parsers; `name` is the `--tool-call-parser` value."""

    name = ""
    # the format's markers are special tokens the detokenizer would drop: decode them
    keeps_special_tokens = True

    def __init__(self, tools: list[dict] | None = None):
        self.tools = tools or []

    def parse(self, text: str, token_ids: list[int], final: bool) -> ToolParse:
        raise NotImplementedError

    def new_call_id(self) -> str:
        return f"call_{secrets.token_hex(12)}"

    def extract(self, text: str, token_ids: list[int]) -> tuple[str, list[ToolCall]]:
        """The final content and the tool calls; on any parse failure, (text, [])."""
        try:
            parsed = self.parse(text, token_ids, final=True)
            calls = [ToolCall(self.new_call_id(), *checked_call(d)) for d in parsed.calls]
        except (ValueError, KeyError, TypeError):
            return text, []
        return parsed.content, calls


def checked_call(draft: CallDraft) -> tuple[str, str]:
    """(name, arguments as compact JSON) of a finished call; ValueError when it is not one."""
    if not draft.complete or not draft.name:
        raise ValueError("incomplete tool call")
    args = json.loads(draft.arguments) if draft.arguments.strip() else {}
    if isinstance(args, str):  # some models write the arguments as a JSON string of JSON
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError("tool call arguments are not a JSON object")
    return draft.name, json.dumps(args, ensure_ascii=False)


def draft_from_object(s: str, i: int, name_keys=("name",), arg_keys=("arguments", "parameters")) -> CallDraft:
    """A call from a `{"name": ..., "arguments": {...}}` object at `s[i]`, as far as it is written.

    Arguments stream as raw text when they are an object; a string value (JSON in a string) is
    given only once whole, decoded, since its escaped form is not the JSON the client wants."""
    scan: ObjectScan = scan_object(s, i)
    name = next((scan.string(s, k) for k in name_keys if scan.string(s, k) is not None), None)
    key = next((k for k in arg_keys if k in scan.fields), None)
    args = ""
    if key is not None:
        raw = scan.raw(s, key) or ""
        if raw.startswith('"'):
            args = scan.string(s, key) or ""
        else:
            args = raw
    elif scan.end is not None:
        args = "{}"  # a call without arguments
    return CallDraft(name, args, complete=scan.end is not None)


def first_object(s: str) -> int | None:
    """Where the first JSON object of `s` starts (after whitespace); None when `s` is only whitespace."""
    i = skip_ws(s, 0)
    if i >= len(s):
        return None
    if s[i] != "{":
        raise ValueError("expected a JSON object")
    return i


_ALNUM = string.ascii_letters + string.digits


def alnum_id(length: int = 9) -> str:
    """Mistral's chat templates require tool call ids of exactly nine letters and digits."""
    return "".join(secrets.choice(_ALNUM) for _ in range(length))
