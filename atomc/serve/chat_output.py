"""A chat choice's output read for reasoning and tool calls: one `ChoiceParser` per choice.

The order is vLLM's: the reasoning parser splits off the reasoning first, then the tool parser
reads what is left. Both read the cumulative output (text and token ids) and say what it means so
far (see the two `base.py` contracts); `delta` turns that into one chunk's delta by difference
with what this choice already sent: reasoning and content pieces, and per tool call first its
`id`, `type` and `function.name`, then `function.arguments` in pieces, each with the call's `index`.
`message` is the non-streaming form, with the checked whole-output parse: a call that does not
parse leaves its text in the content instead (never an error).

`ChatOutputSetup` is the request's choice of parsers; `None` of it (no reasoning parser, no tool
parsing) keeps the plain path, which never builds a parser.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from atomc.serve.reasoning_parsers import ReasoningParser, reasoning_parser_class
from atomc.serve.tool_parsers import ToolCall, ToolParser, tool_parser_class
from atomc.serve.tool_parsers.constrained import NamedFunctionParser, RequiredCallsParser


@dataclass(frozen=True)
class ChatOutputSetup:
    """How one request's choices are read. `tool_mode`: None (no tool parsing), "auto" (the
    format parser `tool_parser`), "required" or "named" (the constrained JSON)."""

    reasoning_parser: str | None = None
    tool_mode: str | None = None
    tool_parser: str | None = None
    function_name: str | None = None  # the named function
    tools: list[dict] = field(default_factory=list)
    parallel_tool_calls: bool = True  # False: only the first call is kept

    @property
    def active(self) -> bool:
        return self.reasoning_parser is not None or self.tool_mode is not None

    def choice_parser(self, prompt: str | None) -> ChoiceParser:
        # the constrained modes write JSON from the first token: there is no reasoning to split off
        constrained = self.tool_mode in ("required", "named")
        reasoning = None
        if self.reasoning_parser is not None and not constrained:
            reasoning = reasoning_parser_class(self.reasoning_parser)(prompt)
        tools: ToolParser | None = None
        if self.tool_mode == "auto":
            tools = tool_parser_class(self.tool_parser)(self.tools)
        elif self.tool_mode == "required":
            tools = RequiredCallsParser(self.tools)
        elif self.tool_mode == "named":
            tools = NamedFunctionParser(self.function_name)
        max_calls = None if self.parallel_tool_calls else 1
        return ChoiceParser(reasoning, tools, reports_reasoning=self.reasoning_parser is not None, max_calls=max_calls)


@dataclass
class _Sent:
    reasoning: int = 0
    content: int = 0
    calls: list[list] = field(default_factory=list)  # per call: [id, name sent, arguments sent]


class ChoiceParser:
    def __init__(
        self,
        reasoning: ReasoningParser | None,
        tools: ToolParser | None,
        reports_reasoning: bool,
        max_calls: int | None = None,
    ):
        self.reasoning, self.tools, self.reports_reasoning = reasoning, tools, reports_reasoning
        self.max_calls = max_calls
        self.sent = _Sent()

    @property
    def made_calls(self) -> bool:
        return bool(self.sent.calls)

    def _split(self, text: str, ids: list[int], final: bool) -> tuple[str | None, str]:
        if self.reasoning is None:
            return None, text
        return self.reasoning.split(text, ids, final)

    # ---- streaming
    def delta(self, text: str, ids: list[int], final: bool) -> dict:
        """The delta for one chunk: what the output so far adds to what this choice sent."""
        reasoning, content = self._split(text, ids, final)
        calls = []
        if self.tools is not None:
            try:
                parsed = self.tools.parse(content, ids, final)
                content, calls = parsed.content, parsed.calls[: self.max_calls]
            except ValueError:  # not calls after all: what was not sent as a call is content
                pass
        out: dict = {}
        s = self.sent
        if reasoning is not None and len(reasoning) > s.reasoning:
            out["reasoning_content"] = out["reasoning"] = reasoning[s.reasoning :]
            s.reasoning = len(reasoning)
        # a call already streamed cannot be taken back: if the output turns out not to parse, its
        # text does not come again as content
        fell_back = bool(s.calls) and not calls
        if len(content) > s.content and not fell_back:
            out["content"] = content[s.content :]
            s.content = len(content)
        tool_deltas = []
        for i, call in enumerate(calls):
            if call.name is None:
                break
            if i == len(s.calls):
                s.calls.append([self.tools.new_call_id(), call.name, 0])
                tool_deltas.append(
                    {
                        "index": i,
                        "id": s.calls[i][0],
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                )
            sent_args = s.calls[i][2]
            if len(call.arguments) > sent_args:
                piece = {"index": i, "function": {"arguments": call.arguments[sent_args:]}}
                if tool_deltas and tool_deltas[-1]["index"] == i:
                    tool_deltas[-1]["function"]["arguments"] += piece["function"]["arguments"]
                else:
                    tool_deltas.append(piece)
                s.calls[i][2] = len(call.arguments)
        if tool_deltas:
            out["tool_calls"] = tool_deltas
        return out

    # ---- whole output
    def message(self, text: str, ids: list[int]) -> dict:
        reasoning, content = self._split(text, ids, final=True)
        calls: list[ToolCall] = []
        if self.tools is not None:
            content, calls = self.tools.extract(content, ids)
            calls = calls[: self.max_calls]
        msg: dict = {"role": "assistant", "content": content}
        if self.reports_reasoning:
            msg["reasoning_content"] = msg["reasoning"] = reasoning
        if calls:
            msg["tool_calls"] = [c.to_dict() for c in calls]
            if not content.strip():
                msg["content"] = None
            self.sent.calls = [[c.id, c.name, len(c.arguments)] for c in calls]  # for made_calls
        return msg
