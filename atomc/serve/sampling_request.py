"""The sampling fields completions and chat share, and their validation into `SamplingParams`.

`SamplingRequest` is the base of both request models (completion_request.py, chat_request.py): it
declares OpenAI's and vLLM's sampling fields, applies the model's generation defaults to the ones a
request leaves unset, refuses what cannot stream, and turns `SamplingParams`' ValueErrors into 400s
naming the field. Unknown fields are ignored (as vLLM does) so newer clients keep working.
The output-constraint fields (`response_format`, `structured_outputs`, `guided_*`) are read by
response_format.py.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from atomc.sampling_params import LOGIT_BIAS_RANGE, SamplingParams
from atomc.serve.api_errors import bad_request
from atomc.serve.response_format import FieldError, structured_outputs

MAX_N = 128  # choices per prompt; larger fan-outs are more likely mistakes than workloads
_SEED_RANGE = dict(ge=-(2**63), le=2**63 - 1)  # int64, as vLLM; seed + sample index still fits manual_seed


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingRequest(BaseModel):
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
