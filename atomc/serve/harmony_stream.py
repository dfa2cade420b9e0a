"""GPT-OSS's harmony format read from the generated token ids, through the `openai-harmony` package.

Harmony output is a run of messages, each on a channel: `analysis` (the chain of thought),
`commentary` (tool calls, addressed `to=functions.NAME`, and preambles meant for the user) and
`final` (the answer). Its markers are special tokens, so the text (decoded without them) cannot be
split reliably: both `openai` parsers, reasoning and tools, read the token ids. The package's
`StreamableParser` is fed only the ids not seen yet, so streaming costs one pass over the output.

The encoding (the o200k vocabulary) is loaded once per process; the package reads it from
`TIKTOKEN_ENCODINGS_BASE` or downloads it, so an offline machine needs that folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

FUNCTIONS = "functions."


@dataclass
class HarmonyMessage:
    channel: str | None
    recipient: str | None
    text: str
    complete: bool = True


@cache
def harmony_encoding():
    try:
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding
    except ImportError:
        raise RuntimeError("the openai (harmony) parsers need openai-harmony: pip install 'atomc[harmony]'") from None
    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as e:
        raise RuntimeError(
            f"the openai (harmony) parsers need openai-harmony's GPT-OSS encoding, which did not load ({e}); "
            "on a machine without network access put o200k_base.tiktoken in a folder and name it in "
            "TIKTOKEN_ENCODINGS_BASE"
        ) from None


class HarmonyStream:
    """The messages of one choice's output, fed incrementally (token ids only ever grow)."""

    def __init__(self):
        from openai_harmony import Role, StreamableParser

        self._parser = StreamableParser(harmony_encoding(), role=Role.ASSISTANT)
        self._fed = 0
        self._ended = False

    def messages(self, token_ids: list[int], final: bool) -> list[HarmonyMessage]:
        """Every message so far, the one still being written last; ValueError on malformed output."""
        p = self._parser
        try:
            for t in token_ids[self._fed :]:
                p.process(t)
            self._fed = len(token_ids)
            if final and not self._ended:
                self._ended = True
                p.process_eos()
        except Exception as e:  # the package's HarmonyError: the output is not harmony
            raise ValueError(f"not harmony output: {e}") from None
        out = [HarmonyMessage(m.channel, m.recipient, _text(m)) for m in p.messages]
        if p.current_content:
            out.append(HarmonyMessage(p.current_channel, p.current_recipient, p.current_content, complete=False))
        return out


def _text(message) -> str:
    return "".join(getattr(c, "text", "") for c in message.content)


def is_call(m: HarmonyMessage) -> bool:
    return bool(m.recipient) and m.recipient.startswith(FUNCTIONS)


def visible_text(messages: list[HarmonyMessage]) -> str:
    """What the user reads: the final channel, and commentary addressed to nobody (preambles)."""
    return "".join(m.text for m in messages if m.channel == "final" or (m.channel == "commentary" and not m.recipient))


def reasoning_text(messages: list[HarmonyMessage]) -> str:
    return "".join(m.text for m in messages if m.channel == "analysis")
