"""OpenAI request models, their validation into `SamplingParams`, and the error shape.

Unknown fields are ignored (as vLLM does) so newer clients keep working; fields we cannot honour
(`suffix`, non-text content) are rejected with 400 rather than silently dropped.
Tools: `tools`, `tool_choice` and `parallel_tool_calls` resolve into a `ChatOutputSetup` (which
parser reads the output, atomc/serve/chat_output.py) and, for `required` and a named function, a
JSON-schema constraint in `SamplingParams.structured_outputs` (tool_parsers/constrained.py).
The output-constraint fields (`response_format`, `structured_outputs`, `guided_*`) are read by
response_format.py.
Wrong types, bad values and bodies that are not JSON are 400 `invalid_request_error` (OpenAI's and
vLLM's code). Before the models see a body, `check_json_body` refuses what would break later stages:
nesting deeper than `MAX_JSON_DEPTH` and strings holding lone UTF-16 surrogates (not UTF-8, so the
tokenizer cannot take them). `RequestLimits` bounds the work one request may ask for.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from atomc.sampling_params import LOGIT_BIAS_RANGE, SamplingParams, StructuredOutputsParams
from atomc.serve.chat_output import ChatOutputSetup
from atomc.serve.response_format import FieldError, structured_outputs
from atomc.serve.tool_parsers import tool_parser_class
from atomc.serve.tool_parsers.constrained import named_schema, required_schema

if TYPE_CHECKING:
    from atomc.config import ServeConfig

MAX_N = 128  # choices per prompt; larger fan-outs are more likely mistakes than workloads
MAX_JSON_DEPTH = 32  # chat content parts are 5 levels; a tool schema adds two per nested object
_SEED_RANGE = dict(ge=-(2**63), le=2**63 - 1)  # int64, as vLLM; seed + sample index still fits manual_seed


class APIError(Exception):
    """An error with an HTTP status, rendered as OpenAI's {"error": {...}} body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat; null means "the default", as in OpenAI's API."""

    # NaN / Infinity are valid to Python's JSON parser but never a valid sampling value
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    n: int | None = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(default=None, **_SEED_RANGE)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling fields (openai SDK: extra_body)
    best_of: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    # constrained output (response_format.py reads them): OpenAI's, vLLM's, vLLM's older names
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    _constraint_field: str | None = None  # the field the output constraint came from (for its errors)

    @property
    def constraint_field(self) -> str | None:
        return self._constraint_field

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
        defaults: dict,
        **extra: Any,
    ):
        """`defaults`: the model's values for fields the request leaves unset (generation_config.json)."""
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise bad_request(f"n must be in [1, {MAX_N}], got {self.n}", "n")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        self._check_stream_fields()
        try:
            constraint, self._constraint_field = structured_outputs(self)
        except FieldError as e:
            raise bad_request(str(e), e.param) from None
        kw: dict[str, Any] = dict(
            n=self.n if self.n is not None else 1,
            temperature=_default(self.temperature, defaults.get("temperature", 1.0)),
            top_p=_default(self.top_p, defaults.get("top_p", 1.0)),
            top_k=_default(self.top_k, defaults.get("top_k", 0)),
            min_p=_default(self.min_p, defaults.get("min_p", 0.0)),
            presence_penalty=_default(self.presence_penalty, 0.0),
            frequency_penalty=_default(self.frequency_penalty, 0.0),
            repetition_penalty=_default(self.repetition_penalty, defaults.get("repetition_penalty", 1.0)),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=_logit_bias(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            best_of=self.best_of,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            structured_outputs=constraint,
        )
        if extra.get("structured_outputs") is not None:  # tool_choice required / a named function
            if constraint is not None:
                field = self._constraint_field
                raise bad_request(f"{field} cannot be combined with a tool_choice that constrains the output", field)
            self._constraint_field = "tools"  # a tool schema the grammar engine refuses is the tools' fault
        kw.update(extra)
        if any(t < 0 for t in kw["stop_token_ids"] or []):
            raise bad_request("stop_token_ids must be non-negative", "stop_token_ids")
        try:
            return SamplingParams(**kw)
        except ValueError as e:  # SamplingParams' messages start with the field name
            first = str(e).split(" ", 1)[0]
            raise bad_request(str(e), first if first in kw else None) from None

    def _check_stream_fields(self) -> None:
        """What cannot stream, refused as vLLM refuses it: best_of > n (the best are known only at
        the end) and prompt logprobs (vLLM sends them in no chunk)."""
        if not self.stream:
            return
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise bad_request(
                "best_of must equal n when stream is true (the best samples are known only at the end)", "best_of"
            )
        if self.prompt_logprobs is not None and self.prompt_logprobs > 0:
            raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")


def _default(value, default):
    return default if value is None else value


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} as {id: bias}, each bias clamped to [-100, 100] as vLLM does."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if token < 0:
            raise bad_request(f"logit_bias keys must be token ids >= 0, got {key!r}", "logit_bias")
        out[token] = min(LOGIT_BIAS_RANGE, max(-LOGIT_BIAS_RANGE, value))
    return out


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        prompts: list = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not prompts:
            raise bad_request("prompt must not be empty", "prompt")
        for one in prompts:
            if len(one) == 0:
                raise bad_request("prompt must not be empty", "prompt")
            if not isinstance(one, str) and min(one) < 0:
                raise bad_request("prompt token ids must be non-negative", "prompt")
        return prompts

    def sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        # echo + logprobs also scores the prompt tokens (what lm-eval's loglikelihood reads)
        prompt_lp = self.prompt_logprobs
        if prompt_lp is None and self.echo and self.logprobs is not None:
            prompt_lp = self.logprobs
        return self._sampling_params(self.max_tokens, self.logprobs, prompt_lp, defaults or {})


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str


class ToolCallItem(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, reasoning_content, ... pass through to the template
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None

    def to_template(self) -> dict:
        if self.role == "tool" and not self.tool_call_id:
            raise bad_request("a message with role 'tool' needs its tool_call_id", "messages")
        msg = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            if any(p.type != "text" or p.text is None for p in self.content):
                raise bad_request("only text content parts are supported", "messages")
            msg["content"] = "".join(p.text for p in self.content)
        msg.setdefault("content", "")
        for call in msg.get("tool_calls", []):
            # chat templates expect the arguments as a mapping (transformers' convention), where
            # OpenAI's history carries their JSON text
            call["function"]["arguments"] = _arguments_for_template(call["function"]["arguments"])
        return msg


def _arguments_for_template(arguments: str):
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


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


class ChatCompletionRequest(_SamplingRequest):
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


class TokenizeCompletionRequest(BaseModel):
    """POST /tokenize with a prompt (vLLM's shape)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    """POST /tokenize with chat messages, rendered by the chat template first (vLLM's shape)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template writes BOS and friends itself
    return_token_strs: bool | None = False
    tools: list[dict] | None = None  # rendered by the template as chat renders them
    chat_template_kwargs: dict[str, Any] | None = None  # the template's variables (enable_thinking, ...)

    def template_messages(self) -> list[dict]:
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true", "continue_final_message"
            )
        return [m.to_template() for m in self.messages]


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's shape): token ids in, `{"prompt": text}` out."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


def tokenize_request_model(data: Any) -> type[BaseModel]:
    """/tokenize takes either shape; `messages` picks the chat one, as vLLM's union does."""
    return TokenizeChatRequest if isinstance(data, dict) and "messages" in data else TokenizeCompletionRequest


def check_json_body(data: Any) -> None:
    """400 for nesting deeper than MAX_JSON_DEPTH or a string that is not valid Unicode (a lone
    surrogate from a `\\ud800` escape); one iterative walk, so no depth can overflow the stack."""
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, str):
            _check_text(value, where)
            continue
        if not isinstance(value, dict | list):
            continue
        if depth > MAX_JSON_DEPTH:
            field = where.split(".")[0].split("[")[0] or None
            raise bad_request(f"request body is nested deeper than {MAX_JSON_DEPTH} levels", field)
        if isinstance(value, dict):
            for k, v in value.items():
                _check_text(k, where)
                if isinstance(v, str | dict | list):
                    stack.append((v, depth + 1, f"{where}.{k}" if where else k))
        else:
            for i, v in enumerate(value):
                if isinstance(v, str | dict | list):
                    stack.append((v, depth + 1, f"{where}[{i}]"))


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        field = where.split(".")[0].split("[")[0] or None
        message = f"{where or 'a key'}: string holds a lone UTF-16 surrogate, which is not valid Unicode"
        raise bad_request(message, field) from None


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on the work one request may ask for (ServeConfig's max_*_per_request)."""

    max_prompts: int
    max_seqs: int
    max_logprob_entries: int
    max_model_len: int

    def check(self, prompts: list, params: SamplingParams) -> None:
        if len(prompts) > self.max_prompts:
            raise bad_request(
                f"{len(prompts)} prompts in one request; at most {self.max_prompts} (--max-prompts-per-request)",
                "prompt",
            )
        samples = params.num_samples  # best_of runs more sequences than it returns
        seqs = len(prompts) * samples
        if seqs > self.max_seqs:
            raise bad_request(
                f"{len(prompts)} prompts x {'best_of' if params.best_of else 'n'}={samples} = {seqs} sequences; "
                f"at most {self.max_seqs} (--max-seqs-per-request)",
                "best_of" if params.best_of else "n",
            )
        entries, tokens, per_token = 0, 0, 0
        if params.logprobs is not None:
            per_token = params.logprobs + 1  # the sampled token and the top-N
            generated = params.max_tokens if params.max_tokens is not None else self.max_model_len
            tokens = len(prompts) * params.n * min(generated, self.max_model_len)
            entries += tokens * per_token
        if params.prompt_logprobs is not None:
            # every choice carries its prompt's scores; a prompt has at most one token per UTF-8 byte
            scored = params.n * sum(min(_token_bound(p), self.max_model_len) for p in prompts)
            tokens += scored
            per_token = max(per_token, params.prompt_logprobs + 1)
            entries += scored * (params.prompt_logprobs + 1)
        if entries > self.max_logprob_entries:
            raise bad_request(
                f"the response could carry {entries} logprob entries ({tokens} tokens x up to "
                f"{per_token}); at most {self.max_logprob_entries} (--max-logprob-entries-per-request): "
                "lower logprobs, prompt_logprobs, max_tokens, n or the number of prompts",
                "logprobs" if params.logprobs is not None else "prompt_logprobs",
            )


def _token_bound(prompt) -> int:
    if prompt is None:  # a chat prompt, not rendered yet: the context bounds it
        return 2**31
    if isinstance(prompt, str):
        return len(prompt.encode("utf-8")) + 2  # byte-level vocabularies; + BOS / EOS
    return len(prompt)


def parse_request(model: type[BaseModel], data: Any) -> Any:
    """Validate a decoded JSON body; pydantic errors become one readable 400."""
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    check_json_body(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        # a union reports one error per member; the first is the most readable
        err = e.errors()[0]
        param = str(err["loc"][0]) if err["loc"] else None
        where = ".".join(str(x) for x in err["loc"])
        raise bad_request(f"{where}: {err['msg']}" if where else err["msg"], param) from None


# ---------------------------------------------------------------- response shapes
# Plain dicts, not pydantic models: they are built per streamed token and only ever serialized.

TokenStr = Callable[[int], str]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _lp(value: float | None) -> float | None:
    # -inf is not valid JSON; vLLM clamps the same way
    return None if value is None else max(float(value), -9999.0)


def _ranked(lp: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(lp.items(), key=lambda kv: -kv[1])


def legacy_logprobs(
    token_ids: list[int], logprobs: list[dict[int, float] | None], token_str: TokenStr, text_offset: int
) -> dict:
    """Completions' logprobs: parallel lists; `None` entries (the first prompt token) stay None."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, lp in zip(token_ids, logprobs, strict=False):
        s = token_str(tid)
        tokens.append(s)
        offsets.append(text_offset)
        text_offset += len(s)
        if lp is None:
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(_lp(lp.get(tid)))
            tops.append({token_str(t): _lp(v) for t, v in _ranked(lp)})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def merge_legacy(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}


def prompt_logprobs_json(
    token_ids: list[int], logprobs: list[dict[int, float] | None] | None, top_n: int, token_str: TokenStr
) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first (nothing before it to score),
    else {"id": {"logprob", "rank", "decoded_token"}} for the token itself and the `top_n` most
    likely. A rank is the place among those (1 = the most likely); the prompt token's own is null
    when it is not among them (its place is not computed)."""
    if logprobs is None:
        return None
    out: list[dict | None] = []
    for tid, lp in zip(token_ids, logprobs, strict=False):
        if lp is None:
            out.append(None)
            continue
        in_top = len(lp) <= top_n  # the scored token is one of the top N (else it was added to them)
        ranked = [t for t, _ in _ranked(lp) if in_top or t != tid]
        out.append(
            {
                str(t): {
                    "logprob": _lp(v),
                    "rank": ranked.index(t) + 1 if t in ranked else None,
                    "decoded_token": token_str(t),
                }
                for t, v in lp.items()
            }
        )
    return out


def chat_logprobs(
    token_ids: list[int], logprobs: list[dict[int, float]], token_str: TokenStr, top_n: int
) -> list[dict]:
    """Chat's logprobs.content entries: the sampled token plus its `top_n` alternatives."""

    def entry(tid: int, value: float | None) -> dict:
        s = token_str(tid)
        return {"token": s, "logprob": _lp(value), "bytes": list(s.encode("utf-8"))}

    content = []
    for tid, lp in zip(token_ids, logprobs, strict=False):
        item = entry(tid, lp.get(tid))
        item["top_logprobs"] = [entry(t, v) for t, v in _ranked(lp)[:top_n]]
        content.append(item)
    return content
