"""`RequestLimits`: bounds on the work one request may ask for (ServeConfig's max_*_per_request).

Checked once the prompts and `SamplingParams` are known and before anything reaches the engine:
the number of prompts, of sequences (prompts x n, or x best_of) and of logprob entries the
response could carry, each refused with a 400 that names the flag raising it.
"""

from __future__ import annotations

from dataclasses import dataclass

from atomc.sampling_params import SamplingParams
from atomc.serve.api_errors import bad_request


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
