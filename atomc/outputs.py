"""What generation returns, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

# One generated position: {token_id: logprob} holding the sampled token and the top-N.
Logprobs = dict[int, float]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    logprobs: list[Logprobs] | None = None  # one dict per generated token when requested
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[Logprobs | None] | None = None
    metrics: dict = field(default_factory=dict)  # arrival, first-token and finish times (perf_counter seconds)
    # set when the engine failed this request (a step it was in raised); the text is for the log only
    error: str | None = None


def best_of(out: RequestOutput, n: int) -> RequestOutput:
    """`out` with only its `n` samples of highest cumulative logprob, re-indexed 0..n-1 in that order
    (`best_of` > n: the engine ran every sample; this picks what the caller returns). Ties keep the
    sample order; a sample without a cumulative logprob (aborted before its first token) ranks last."""
    if len(out.outputs) <= n:
        return out
    ranked = sorted(
        out.outputs,
        key=lambda c: (c.cumulative_logprob is None, -(c.cumulative_logprob or 0.0), c.index),
    )[:n]
    kept = [dataclasses.replace(c, index=i) for i, c in enumerate(ranked)]
    return dataclasses.replace(out, outputs=kept)
