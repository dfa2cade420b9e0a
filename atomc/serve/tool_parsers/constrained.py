"""`tool_choice: "required"` and a named function: the output is constrained to JSON, so the calls
are read from that JSON, not from a model format (as vLLM does).

The schema goes into `SamplingParams.structured_outputs`; the grammar engine then allows only
output that matches it, which is what makes these two modes well formed by construction:

- named: the function's `parameters` schema; the whole output is that call's arguments;
- required: an array (at least one item; exactly one when `parallel_tool_calls` is false) of
  `{"name": <a tool's name>, "parameters": <that tool's schema>}`, one `anyOf` branch per tool.

The two parsers below stream the calls the same way the format parsers do (base.py's contract).
"""

from __future__ import annotations

from atomc.serve.tool_parsers.base import CallDraft, ToolParse, ToolParser, draft_from_object
from atomc.serve.tool_parsers.json_scan import skip_ws, value_end

ANY_OBJECT = {"type": "object"}


def parameters_schema(tool: dict) -> dict:
    return tool["function"].get("parameters") or ANY_OBJECT


def named_schema(tool: dict) -> dict:
    return parameters_schema(tool)


def required_schema(tools: list[dict], parallel: bool) -> dict:
    branches = [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, "parameters": parameters_schema(t)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class NamedFunctionParser(ToolParser):
    """The whole output is the arguments of the one named function."""

    keeps_special_tokens = False

    def __init__(self, function_name: str):
        super().__init__()
        self.function_name = function_name

    def parse(self, text: str, token_ids: list[int], final: bool) -> ToolParse:
        i = skip_ws(text, 0)
        if i >= len(text):
            if final:
                raise ValueError("no arguments")
            return ToolParse("", [])
        end = value_end(text, i)
        if final and end is None:
            raise ValueError("unfinished arguments")
        return ToolParse("", [CallDraft(self.function_name, text[i:end], complete=end is not None)])


class RequiredCallsParser(ToolParser):
    """The output is a JSON array of {"name", "parameters"} objects."""

    keeps_special_tokens = False

    def parse(self, text: str, token_ids: list[int], final: bool) -> ToolParse:
        calls: list[CallDraft] = []
        i = skip_ws(text, 0)
        if i < len(text):
            if text[i] != "[":
                raise ValueError("expected a JSON array of calls")
            i = skip_ws(text, i + 1)
            while i < len(text) and text[i] != "]":
                draft = draft_from_object(text, i, arg_keys=("parameters",))
                if draft.name is not None:
                    calls.append(draft)
                if not draft.complete:
                    break
                i = skip_ws(text, value_end(text, i) or len(text))
                if i < len(text) and text[i] == ",":
                    i = skip_ws(text, i + 1)
            else:
                if i < len(text):  # the closing bracket
                    return ToolParse("", calls) if calls else _no_calls(final)
        if final:
            # the output ended inside the array (max_tokens): the calls completed so far stand, the
            # cut one is dropped; with none complete there is nothing to return but the text
            complete = [c for c in calls if c.complete]
            if not complete:
                raise ValueError("unfinished call array")
            return ToolParse("", complete)
        return ToolParse("", calls)


def _no_calls(final: bool) -> ToolParse:
    if final:
        raise ValueError("an empty call array")
    return ToolParse("", [])
