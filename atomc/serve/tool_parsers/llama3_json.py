"""`llama3_json`: Llama 3.1 / 3.2 / 3.3 JSON tool calls. The whole reply is the call:

    {"name": "get_weather", "parameters": {"city": "Paris"}}

optionally after `<|python_tag|>` (a special token, hence decoded with special tokens kept), with
`"type": "function"` in 3.2's examples, and several calls separated by `;`. A reply that does not
begin with an object (or the tag) is plain content, as is one whose objects are not calls.
"""

from __future__ import annotations

from atomc.serve.tool_parsers.base import CallDraft, ToolParse, ToolParser, draft_from_object
from atomc.serve.tool_parsers.json_scan import skip_ws, value_end

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, token_ids: list[int], final: bool) -> ToolParse:
        i = skip_ws(text, 0)
        rest = text[i:]
        if not final and (not rest or PYTHON_TAG.startswith(rest)):
            return ToolParse("", [])  # nothing yet, or the tag still arriving
        if rest.startswith(PYTHON_TAG):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not rest.startswith("{"):
            return ToolParse(text, [])
        calls: list[CallDraft] = []
        try:
            while i < len(text):
                if text[i] != "{":
                    raise ValueError("expected a call object")
                draft = draft_from_object(text, i)
                if not draft.complete:
                    if final:
                        raise ValueError("unfinished call")
                    if draft.name is not None:
                        calls.append(draft)
                    break
                if draft.name is None:
                    raise ValueError("a call without a name")
                calls.append(draft)
                i = skip_ws(text, value_end(text, i) or len(text))
                if i < len(text) and text[i] == ";":
                    i = skip_ws(text, i + 1)
        except ValueError:
            if final or not calls:
                return ToolParse(text, [])
            return ToolParse("", calls)  # streamed calls stay; the rest of the reply is unreadable
        return ToolParse("", calls)
