"""`mistral`: Mistral tool calls after the `[TOOL_CALLS]` special token, in either of the two
forms Mistral's tokenizers use:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]   (v3 tokenizers)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}                                (v11 and later)

In the later form each call has its own `[TOOL_CALLS]`. Text before the first marker is the
content. Mistral's templates require call ids of nine letters and digits, so this parser makes those.
"""

from __future__ import annotations

from atomc.serve.tool_parsers.base import CallDraft, ToolParse, ToolParser, alnum_id, draft_from_object
from atomc.serve.tool_parsers.json_scan import hold_back, skip_ws, value_end

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"

    def new_call_id(self) -> str:
        return alnum_id()

    def parse(self, text: str, token_ids: list[int], final: bool) -> ToolParse:
        j = text.find(TOOL_CALLS)
        if j < 0:
            return ToolParse(text if final else hold_back(text, TOOL_CALLS).rstrip(), [])
        content, body = text[:j].rstrip(), text[j + len(TOOL_CALLS) :]
        try:
            i = skip_ws(body, 0)
            if i >= len(body):
                if final:
                    raise ValueError("no call after the marker")
                return ToolParse(content, [])
            calls = _array_calls(body, i, final) if body[i] == "[" else _named_calls(body, final)
        except ValueError:
            return ToolParse(text, []) if final else ToolParse(content, [])
        return ToolParse(content, calls)


def _array_calls(s: str, i: int, final: bool) -> list[CallDraft]:
    calls: list[CallDraft] = []
    i = skip_ws(s, i + 1)
    while i < len(s):
        if s[i] == "]":
            return calls
        if s[i] != "{":
            raise ValueError("expected a call object")
        draft = draft_from_object(s, i)
        if draft.name is not None:
            calls.append(draft)
        if not draft.complete:
            break
        if draft.name is None:
            raise ValueError("a call without a name")
        i = skip_ws(s, value_end(s, i) or len(s))
        if i < len(s) and s[i] == ",":
            i = skip_ws(s, i + 1)
    if final:
        raise ValueError("unfinished call array")
    return calls


def _named_calls(s: str, final: bool) -> list[CallDraft]:
    calls: list[CallDraft] = []
    for part in s.split(TOOL_CALLS):
        k = part.find(ARGS)
        if k < 0:
            if final:
                raise ValueError("a call without [ARGS]")
            break  # the name is still arriving
        name = part[:k].strip()
        if not name:
            raise ValueError("a call without a name")
        args = part[k + len(ARGS) :]
        a = skip_ws(args, 0)
        end = value_end(args, a) if a < len(args) else None
        calls.append(CallDraft(name, args[a:end] if end is not None else args[a:], complete=end is not None))
    if final and (not calls or not calls[-1].complete):
        raise ValueError("unfinished call")
    return calls
