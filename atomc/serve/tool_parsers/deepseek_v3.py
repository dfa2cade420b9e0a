"""`deepseek_v3`: DeepSeek-V3 / R1 tool calls, between special-token markers:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

one `tool▁call` block per call. DeepSeek-V3.1's shorter block (`<｜tool▁call▁begin｜>get_weather
<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>`, no type and no code fence) is read too. Text before
`<｜tool▁calls▁begin｜>` is the content.
"""

from __future__ import annotations

from atomc.serve.tool_parsers.base import CallDraft, ToolParse, ToolParser
from atomc.serve.tool_parsers.json_scan import hold_back, skip_ws, value_end

# fullwidth vertical bars (U+FF5C) and lower-one-eighth blocks (U+2581), as in DeepSeek's vocabulary
CALLS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
CALLS_END = "<\uff5ctool\u2581calls\u2581end\uff5c>"
CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
CALL_END = "<\uff5ctool\u2581call\u2581end\uff5c>"
SEP = "<\uff5ctool\u2581sep\uff5c>"
FENCE_OPEN = "```json"


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"

    def parse(self, text: str, token_ids: list[int], final: bool) -> ToolParse:
        j = text.find(CALLS_BEGIN)
        if j < 0:
            return ToolParse(text if final else hold_back(text, CALLS_BEGIN).rstrip(), [])
        content = text[:j].rstrip()
        body = text[j + len(CALLS_BEGIN) :]
        end = body.find(CALLS_END)
        if end >= 0:
            body = body[:end]
        calls: list[CallDraft] = []
        try:
            for block in body.split(CALL_BEGIN)[1:]:
                k = block.find(CALL_END)
                draft = _block_call(block[:k] if k >= 0 else block, closed=k >= 0)
                if draft is None:
                    break
                calls.append(draft)
            if final and (not calls or not all(c.complete for c in calls)):
                raise ValueError("unfinished tool call")
        except ValueError:
            return ToolParse(text, []) if final else ToolParse(content, calls)
        return ToolParse(content, calls)


def _block_call(block: str, closed: bool) -> CallDraft | None:
    s = block.find(SEP)
    if s < 0:
        if closed:
            raise ValueError("a tool call without a separator")
        return None
    head, rest = block[:s].strip(), block[s + len(SEP) :]
    if head == "function":  # V3 / R1: the name on its own line, then the arguments in a json fence
        nl = rest.find("\n")
        if nl < 0:
            if closed:
                raise ValueError("a tool call without arguments")
            return None
        name, rest = rest[:nl].strip(), rest[nl + 1 :]
        f = rest.find(FENCE_OPEN)
        if f < 0:
            if closed:
                raise ValueError("a tool call without a json fence")
            return CallDraft(name, "") if name else None
        rest = rest[f + len(FENCE_OPEN) :]
    else:  # V3.1: the name before the separator
        name = head
    if not name:
        raise ValueError("a tool call without a name")
    a = skip_ws(rest, 0)
    end = value_end(rest, a) if a < len(rest) else None
    if end is None:
        return CallDraft(name, rest[a:], complete=False)  # all of it is the unfinished value
    return CallDraft(name, rest[a:end], complete=True)
