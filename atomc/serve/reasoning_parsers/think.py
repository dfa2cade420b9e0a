"""`deepseek_r1` and `qwen3`: reasoning between `<think>` and `</think>`, the answer after it.

Where the block starts differs, and that is the whole difference between the two:

- DeepSeek-R1's template ends the prompt with `<think>\\n`, so the output holds only the closing
  tag: everything before `</think>` is reasoning, and output that never closes it is all reasoning
  (it was cut off while thinking). An opening tag the model writes itself is dropped.
- Qwen3 writes `<think>` itself, or its template opens the block (the thinking-only models) or
  writes an empty closed one (`enable_thinking: false`). So the block is open when the output
  starts with `<think>` or the prompt ends with it; otherwise the output is all content.

Both read the prompt's end, so a template that closes an empty block (no thinking asked) makes
the whole output content for either parser.
"""

from __future__ import annotations

from atomc.serve.reasoning_parsers.base import ReasoningParser
from atomc.serve.tool_parsers.json_scan import hold_back

START, END = "<think>", "</think>"


class ThinkReasoningParser(ReasoningParser):
    # whether the block counts as open when neither the prompt nor the output says
    open_by_default = False

    def __init__(self, prompt: str | None = None):
        super().__init__(prompt)
        tail = self.prompt.rstrip()
        if tail.endswith(START):
            self.opened_in_prompt: bool = True
        elif tail.endswith(END):
            self.opened_in_prompt = False
        else:
            self.opened_in_prompt = self.open_by_default

    def split(self, text: str, token_ids: list[int], final: bool) -> tuple[str | None, str]:
        body = text.lstrip()
        opened = self.opened_in_prompt
        if body.startswith(START):
            opened, body = True, body[len(START) :]
        elif not opened and not final and START.startswith(body):
            return None, ""  # the opening tag may still be arriving
        if not opened:
            return None, text
        k = body.find(END)
        if k < 0:
            return (body if final else hold_back(body, END)).lstrip("\n"), ""
        return body[:k].lstrip("\n"), body[k + len(END) :].lstrip()


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    name = "deepseek_r1"
    open_by_default = True


class Qwen3ReasoningParser(ThinkReasoningParser):
    name = "qwen3"
