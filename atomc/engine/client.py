"""EngineClient: the interface the server side drives, wherever the engine runs.

`LLMEngine` runs the engine in this process; `EngineProcessClient` (engine/process.py) runs it in
a child process and rebuilds its outputs from per-step deltas. `AsyncEngine` and the API are
written against this protocol, not against either class. Both classes name it as their base, so
the request-side helpers that only read the tokenizer and the generation defaults, which both
hold, are written once here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from atomc.outputs import RequestOutput
from atomc.sampling_params import SamplingParams

if TYPE_CHECKING:
    from atomc.config import EngineConfig
    from atomc.engine.inputs import InputProcessor


class EngineClient(Protocol):
    config: EngineConfig
    model_name: str  # the name the API serves the model under
    max_model_len: int
    tokenizer: Any  # a transformers tokenizer
    inputs: InputProcessor  # prompt checks and tokenization, on the caller's side
    sampling_defaults: dict  # the model's generation defaults (see generation_defaults.py)

    # -- requests: written once, from the tokenizer and the defaults --------------------------------

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.sampling_defaults)

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.inputs.tokenize(prompt, add_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], chat_template: str | None = None, tools: list[dict] | None = None, **kwargs
    ) -> str:
        return self.inputs.apply_chat_template(messages, chat_template, tools=tools, **kwargs)

    # -- what each side implements ------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        add_special_tokens: bool = True,
    ) -> None:
        """Check and queue a request; ValueError when the prompt or the id is not acceptable."""
        ...

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now (its KV blocks are freed); its final output, or None if unknown."""
        ...

    def step(self) -> list[RequestOutput]:
        """Cumulative outputs of the requests that advanced since the last call."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> dict:
        """Scheduler and KV-cache counters (num_running, num_waiting, kv_cache_usage, ...)."""
        ...

    # -- lifetime: nothing to watch or stop for an engine in this process ----------------------------

    @property
    def alive(self) -> bool:
        """False once an engine process has died (it can die while idle)."""
        return True

    def kill(self) -> None:
        """Stop at once, without a clean stop (a second Ctrl-C): an engine process is killed."""

    def close(self) -> None:
        """Stop whatever runs the engine (an engine process is stopped and joined)."""
