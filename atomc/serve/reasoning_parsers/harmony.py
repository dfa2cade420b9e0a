"""`openai`: GPT-OSS reasoning, the harmony `analysis` channel; the content is the `final` channel
(and commentary addressed to nobody). Read from the token ids (atomc/serve/harmony_stream.py).
Output that is not harmony is all content."""

from __future__ import annotations

from atomc.serve.harmony_stream import HarmonyStream, reasoning_text, visible_text
from atomc.serve.reasoning_parsers.base import ReasoningParser


class HarmonyReasoningParser(ReasoningParser):
    name = "openai"

    def __init__(self, prompt: str | None = None):
        super().__init__(prompt)
        self._stream = HarmonyStream()
        self._failed = False

    def split(self, text: str, token_ids: list[int], final: bool) -> tuple[str | None, str]:
        if not self._failed:
            try:
                messages = self._stream.messages(token_ids, final)
                return reasoning_text(messages), visible_text(messages)
            except ValueError:
                self._failed = True
        return None, text
