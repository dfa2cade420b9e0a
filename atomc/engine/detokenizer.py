"""Incremental detokenization: a constant amount of work per generated token.

Fast tokenizers use the `tokenizers` library's DecodeStream (Rust, buffers partial UTF-8 itself).
Other tokenizers decode a small window of ids: text is emitted once the window decodes to more
than its stable prefix and does not end in a partial character. Either way the stream starts with
a few prompt tokens as context, so a first output token that begins with a space keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CONTEXT_TOKENS = 5


@dataclass
class DetokenizerState:
    prefix_offset: int  # window start (context for the next decode)
    read_offset: int  # ids before this index have had their text emitted
    stream: Any = None  # tokenizers.decoders.DecodeStream when the tokenizer is a fast one

    @classmethod
    def start(cls, tokenizer, prompt_ids: list[int], skip_special_tokens: bool) -> DetokenizerState:
        n = len(prompt_ids)
        state = cls(prefix_offset=max(n - CONTEXT_TOKENS, 0), read_offset=n)
        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is not None:
            try:
                from tokenizers.decoders import DecodeStream
            except ImportError:
                return state
            state.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            if n:
                state.stream.step(backend, prompt_ids[state.prefix_offset :])  # context only; its text is dropped
        return state


def decode_step(tokenizer, ids: list[int], state: DetokenizerState, skip_special_tokens: bool) -> str:
    """New text made stable by the last token appended to `ids` (prompt + output)."""
    if state.stream is not None:
        chunk = state.stream.step(tokenizer._tokenizer, ids[-1])
        if chunk is None:
            return ""
        state.prefix_offset, state.read_offset = max(state.read_offset, len(ids) - CONTEXT_TOKENS), len(ids)
        return chunk
    prefix, window = _decode_window(tokenizer, ids, state, skip_special_tokens)
    if len(window) > len(prefix) and not window.endswith("\ufffd"):
        state.prefix_offset, state.read_offset = state.read_offset, len(ids)
        return window[len(prefix) :]
    return ""


def decode_rest(tokenizer, ids: list[int], state: DetokenizerState, skip_special_tokens: bool) -> str:
    """At the end of a sequence: whatever is still held back, partial characters included."""
    if state.read_offset >= len(ids):
        return ""
    prefix, window = _decode_window(tokenizer, ids, state, skip_special_tokens)
    state.prefix_offset = state.read_offset = len(ids)
    return window[len(prefix) :] if window.startswith(prefix) else ""


def _decode_window(tokenizer, ids: list[int], state: DetokenizerState, skip: bool) -> tuple[str, str]:
    """Text of the stable part of the window (ids already emitted) and of the whole window. A streamed
    sequence's tail decodes through the same backend as its stream (no clean-up of spaces that
    transformers' decode may add), so its text does not depend on which tokenizer object holds it."""
    if state.stream is not None:
        backend = tokenizer._tokenizer
        prefix = backend.decode(ids[state.prefix_offset : state.read_offset], skip_special_tokens=skip)
        return prefix, backend.decode(ids[state.prefix_offset :], skip_special_tokens=skip)
    prefix = tokenizer.decode(ids[state.prefix_offset : state.read_offset], skip_special_tokens=skip)
    return prefix, tokenizer.decode(ids[state.prefix_offset :], skip_special_tokens=skip)
