"""`openai`: GPT-OSS tool calls, harmony messages addressed to a function:

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"city": "Paris"}<|call|>

(one line in the output)

read from the token ids (atomc/serve/harmony_stream.py); the message's text is the arguments.
The content is the final channel plus commentary addressed to nobody; the analysis channel is the
reasoning parser's (`--reasoning-parser openai`). Output that is not harmony is plain content.
"""

from __future__ import annotations

from atomc.serve.harmony_stream import FUNCTIONS, HarmonyMessage, HarmonyStream, is_call, visible_text
from atomc.serve.tool_parsers.base import CallDraft, ToolParse, ToolParser


class HarmonyToolParser(ToolParser):
    name = "openai"
    keeps_special_tokens = False  # it reads the ids; the text is only the fallback content

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._stream = HarmonyStream()

    def parse(self, text: str, token_ids: list[int], final: bool) -> ToolParse:
        try:
            messages = self._stream.messages(token_ids, final)
        except ValueError:
            if final:
                raise
            return ToolParse("", [])
        return tool_parse(messages)


def tool_parse(messages: list[HarmonyMessage]) -> ToolParse:
    calls = [CallDraft(m.recipient[len(FUNCTIONS) :], m.text, complete=m.complete) for m in messages if is_call(m)]
    return ToolParse(visible_text(messages), calls)
