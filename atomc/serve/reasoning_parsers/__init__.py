"""Reasoning parsers by their `--reasoning-parser` name (vLLM's names), imported when asked for."""

from __future__ import annotations

from importlib import import_module

from atomc.serve.reasoning_parsers.base import ReasoningParser

__all__ = ["REASONING_PARSERS", "ReasoningParser", "reasoning_parser_class"]

REASONING_PARSERS: dict[str, str] = {
    "deepseek_r1": "think:DeepSeekR1ReasoningParser",
    "qwen3": "think:Qwen3ReasoningParser",
    "openai": "harmony:HarmonyReasoningParser",
}


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not one of: {', '.join(REASONING_PARSERS)}")
    module, cls = REASONING_PARSERS[name].split(":")
    return getattr(import_module(f"{__name__}.{module}"), cls)
