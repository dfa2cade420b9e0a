"""Incremental detokenization: decode only a small window of tokens per step.

Decoding the whole output every step costs O(n^2). Instead two offsets into the sequence's ids
mark a window: text is emitted once the window decodes to more than its stable prefix and does not
end in a partial UTF-8 character. The window starts inside the prompt, so a first output token that
begins with a space keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DetokenizerState:
    prefix_offset: int
    read_offset: int

    @classmethod
    def after_prompt(cls, num_prompt_tokens: int) -> DetokenizerState:
        return cls(prefix_offset=max(num_prompt_tokens - 5, 0), read_offset=num_prompt_tokens)


def decode_step(tokenizer, ids: list[int], state: DetokenizerState, skip_special_tokens: bool) -> str:
    """New text made stable by the tokens appended to `ids` (prompt + output) since the last call."""
    prefix = tokenizer.decode(ids[state.prefix_offset : state.read_offset], skip_special_tokens=skip_special_tokens)
    window = tokenizer.decode(ids[state.prefix_offset :], skip_special_tokens=skip_special_tokens)
    if len(window) > len(prefix) and not window.endswith("\ufffd"):
        state.prefix_offset, state.read_offset = state.read_offset, len(ids)
        return window[len(prefix) :]
    return ""


def decode_rest(tokenizer, ids: list[int], state: DetokenizerState, skip_special_tokens: bool) -> str:
    """At the end of a sequence: whatever the window still holds back, partial characters included."""
    prefix = tokenizer.decode(ids[state.prefix_offset : state.read_offset], skip_special_tokens=skip_special_tokens)
    window = tokenizer.decode(ids[state.prefix_offset :], skip_special_tokens=skip_special_tokens)
    state.prefix_offset = state.read_offset = len(ids)
    return window[len(prefix) :] if window.startswith(prefix) else ""
