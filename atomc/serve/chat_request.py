"""POST /v1/chat/completions' request: messages, chat-template arguments, tools and tool_choice.

Tools: `tools`, `tool_choice` and `parallel_tool_calls` resolve into a `ChatOutputSetup` (which
parser reads the output, chat_output.py) and, for `required` and a named function, a JSON-schema
constraint in `SamplingParams.structured_outputs` (tool_parsers/constrained.py). A tool_choice the
server cannot honour (no tool parser configured, no grammar engine) is a 400 naming it. The
sampling fields and their validation come from sampling_request.py; the messages' and tools'
models from chat_messages.py.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from typing import TYPE_CHECKING, Any

from atomc.sampling_params import SamplingParams, StructuredOutputsParams
from atomc.serve.api_errors import APIError, bad_request
from atomc.serve.chat_messages import ChatMessage, ToolDef
from atomc.serve.chat_output import ChatOutputSetup
from atomc.serve.sampling_request import SamplingRequest
from atomc.serve.tool_parsers import tool_parser_class
from atomc.serve.tool_parsers.constrained import named_schema, required_schema

if TYPE_CHECKING:
    from atomc.config import ServeConfig

# apply_chat_template's own arguments: chat_template_kwargs may not replace them
_TEMPLATE_ARGS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "tokenize", "add_generation_prompt",
     "continue_final_message", "return_dict", "return_tensors", "tokenizer_kwargs"}
)  # fmt: skip


@cache
def constrained_decoding_available() -> bool:
    """Whether this atomc has the grammar engine that enforces `SamplingParams.structured_outputs`
    (atomc.engine.structured_outputs, and xgrammar under it)."""
    if importlib.util.find_spec("atomc.engine.structured_outputs") is None:
        return False
    from atomc.engine import structured_outputs as grammar_engine

    return grammar_engine.available()


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None

    def template_messages(self) -> list[dict]:
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")
        return [m.to_template() for m in self.messages]

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template gets them (also for tool_choice "none", as vLLM renders them)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def template_kwargs(self) -> dict:
        kwargs = dict(self.chat_template_kwargs or {})
        clash = sorted(set(kwargs) & _TEMPLATE_ARGS)
        if clash:
            raise bad_request(f"chat_template_kwargs may not set {', '.join(clash)}", "chat_template_kwargs")
        return kwargs

    def output_setup(self, serve: ServeConfig) -> ChatOutputSetup:
        """Which parsers read this request's output; 400 for a tool_choice this server cannot honour."""
        mode, name = self._tool_mode()
        if mode == "auto" and not (serve.enable_auto_tool_choice and serve.tool_call_parser):
            raise bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                "tool_choice",
            )
        if mode in ("required", "named") and not constrained_decoding_available():
            raise bad_request(
                f"tool_choice {self.tool_choice!r} needs constrained decoding, which this server does not have",
                "tool_choice",
            )
        tools = self.template_tools() or []
        return ChatOutputSetup(
            reasoning_parser=serve.reasoning_parser,
            tool_mode=mode,
            tool_parser=serve.tool_call_parser if mode == "auto" else None,
            function_name=name,
            tools=tools,
            parallel_tool_calls=self.parallel_tool_calls is not False,
        )

    def _tool_mode(self) -> tuple[str | None, str | None]:
        """(None | "auto" | "required" | "named", the named function)."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none"):
                raise bad_request("tool_choice is only allowed when tools are given", "tool_choice")
            return None, None
        if choice is None or choice == "auto":
            return "auto", None
        if choice == "none":
            return None, None
        if choice == "required":
            return "required", None
        if isinstance(choice, dict):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise bad_request(
                    'tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}',
                    "tool_choice",
                )
            if name not in {t.function.name for t in self.tools}:
                raise bad_request(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
            return "named", name
        message = f'tool_choice {choice!r} is not one of "auto", "none", "required" or a function'
        raise bad_request(message, "tool_choice")

    def _tool_constraint(self, setup: ChatOutputSetup) -> StructuredOutputsParams | None:
        # compact JSON: a call's arguments need no layout, and a model left free to emit JSON
        # whitespace can spend its whole budget on it before the call is complete
        if setup.tool_mode == "named":
            tool = next(t for t in setup.tools if t["function"]["name"] == setup.function_name)
            return StructuredOutputsParams(json=named_schema(tool), disable_any_whitespace=True)
        if setup.tool_mode == "required":
            schema = required_schema(setup.tools, self.parallel_tool_calls is not False)
            return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        return None

    def sampling_params(self, defaults: dict | None = None, setup: ChatOutputSetup | None = None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise bad_request(f"top_logprobs must be in [0, 20], got {self.top_logprobs}", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        param = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        extra: dict[str, Any] = {}
        if setup is not None:
            constraint = self._tool_constraint(setup)
            if constraint is not None:
                extra["structured_outputs"] = constraint
            # a format whose markers are special tokens is read with them decoded (as vLLM does),
            # unless the request asked otherwise
            if setup.tool_mode == "auto" and "skip_special_tokens" not in self.model_fields_set:
                if tool_parser_class(setup.tool_parser).keeps_special_tokens:
                    extra["skip_special_tokens"] = False
        try:
            return self._sampling_params(max_tokens, logprobs, self.prompt_logprobs, defaults or {}, **extra)
        except APIError as e:
            if e.param == "max_tokens":
                e.param = param
            raise
