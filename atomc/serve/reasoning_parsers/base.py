"""What a reasoning parser is: cumulative model output in, (reasoning, content) out.

The same contract as the tool-call parsers (atomc/serve/tool_parsers/base.py): the parser reads
the whole output so far and says what it means; streaming sends the differences, so while `final`
is False both parts only grow at their end and a tail that may still become a marker is held back.
`reasoning` is None when the output has no reasoning part at all. The parser also sees the
rendered prompt, because some templates open the reasoning block in the prompt itself.
"""

from __future__ import annotations


class ReasoningParser:
    name = ""  # the `--reasoning-parser` value

    def __init__(self, prompt: str | None = None):
        self.prompt = prompt or ""

    def split(self, text: str, token_ids: list[int], final: bool) -> tuple[str | None, str]:
        raise NotImplementedError
