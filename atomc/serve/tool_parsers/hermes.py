"""`hermes`: Hermes 2 Pro / Qwen 2.5 / Qwen 3 tool calls, one JSON object per block:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Blocks may follow one another (parallel calls) and text may stand before them; the text outside
blocks is the content (whitespace around a block dropped). A block that does not hold a call object
is kept in the content as written.
"""

from __future__ import annotations

from atomc.serve.tool_parsers.base import CallDraft, ToolParse, ToolParser, draft_from_object, first_object
from atomc.serve.tool_parsers.json_scan import hold_back

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, token_ids: list[int], final: bool) -> ToolParse:
        content: list[str] = []
        calls: list[CallDraft] = []
        pos = 0
        while True:
            j = text.find(START, pos)
            if j < 0:
                tail = text[pos:]
                # while streaming, trailing whitespace waits: it is dropped if a block follows
                tail = tail if final else hold_back(tail, START).rstrip()
                content.append(tail.lstrip() if calls else tail)
                break
            content.append(text[pos:j].rstrip() if not calls else text[pos:j].strip())
            k = text.find(END, j + len(START))
            closed = k >= 0
            body = text[j + len(START) : k if closed else len(text)]
            if not closed and not final:
                body = hold_back(body, END)
            draft = _block_call(body, closed or final)
            if draft is None:
                if not closed and not final:
                    break  # still arriving: nothing to say about it yet
                content.append(text[j : k + len(END) if closed else len(text)])
            else:
                calls.append(draft)
            if not closed:
                break
            pos = k + len(END)
        return ToolParse("".join(content), calls)


def _block_call(body: str, closed: bool) -> CallDraft | None:
    """The call in a block's body; None when the body is not (or, while open, not yet) a call."""
    try:
        i = first_object(body)
        if i is None:
            return None
        draft = draft_from_object(body, i)
    except ValueError:
        return None
    if closed and not draft.complete:
        return None
    if draft.name is None:
        return None  # no name yet (or none at all): stream nothing of it
    return draft
