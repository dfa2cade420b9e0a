"""Tool-call parsers, one file per output format, by their `--tool-call-parser` name (vLLM's names).

Parsers are imported when first asked for, so the server imports only the one it serves with
(the `openai` one brings in `openai-harmony`).
"""

from __future__ import annotations

from importlib import import_module

from atomc.serve.tool_parsers.base import CallDraft, ToolCall, ToolParse, ToolParser

__all__ = ["CallDraft", "ToolCall", "ToolParse", "ToolParser", "TOOL_PARSERS", "tool_parser_class"]

TOOL_PARSERS: dict[str, str] = {
    "hermes": "hermes:HermesToolParser",
    "llama3_json": "llama3_json:Llama3JsonToolParser",
    "mistral": "mistral:MistralToolParser",
    "deepseek_v3": "deepseek_v3:DeepSeekV3ToolParser",
    "openai": "harmony:HarmonyToolParser",
}


def tool_parser_class(name: str) -> type[ToolParser]:
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not one of: {', '.join(TOOL_PARSERS)}")
    module, cls = TOOL_PARSERS[name].split(":")
    return getattr(import_module(f"{__name__}.{module}"), cls)
