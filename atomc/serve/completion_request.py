"""POST /v1/completions' request: prompts (text or token ids) and the sampling fields.

The completion-only fields live here: `prompt` in its four shapes, `logprobs` as a count, `echo`
(which with logprobs also scores the prompt, what lm-eval's loglikelihood reads) and `suffix`, which
atomc cannot honour and refuses with 400 rather than silently drop.
"""

from __future__ import annotations

from atomc.sampling_params import SamplingParams
from atomc.serve.api_errors import bad_request
from atomc.serve.sampling_request import SamplingRequest


class CompletionRequest(SamplingRequest):
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
