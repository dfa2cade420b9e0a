"""SamplingParams: vLLM's names and defaults; validated at construction so bad values never reach the engine.

The sampler casts the float fields to float32 on the device: a value that is not finite, overflows
float32 (a temperature of 1e39 becomes inf) or underflows to zero there (a top_p of 5e-324 becomes 0,
which masks every token) is refused here with the field's name, not left to empty a row mid-batch.

Token-level fields (`logit_bias`, `allowed_token_ids`, `bad_words`) are checked here for shape and
range; their ids are checked against the model's vocabulary where the vocabulary is known (the
engine's input processor), and `bad_words` are tokenized there too (`bad_words_token_ids`).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

# the float fields, each cast to float32 by the sampler
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: a bias is in [-100, 100]
MAX_BAD_WORDS = 128  # words (after tokenization, both spellings) one request may ban, as vLLM bounds them


@dataclass
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's `structured_outputs` names); exactly one
    kind is set. The grammar engine compiles it once per distinct value and masks the logits with it."""

    json: str | dict | None = None  # a JSON schema (a dict, or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF-style) text
    json_object: bool = False  # any JSON object, no schema
    # no whitespace between JSON tokens: shorter outputs, and what `strict` schemas get from OpenAI
    disable_any_whitespace: bool = False

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        set_kinds = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                f"structured outputs take exactly one of {', '.join(self.KINDS)}; got {set_kinds or 'none'}"
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured outputs choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))


def as_float32(value: float) -> float:
    """`value` as float32 holds it; OverflowError when float32 cannot hold it at all."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (the sampled one is always included)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # words whose last token is banned once the rest was generated
    best_of: int | None = None  # sample this many, return the n with the highest cumulative logprob
    truncate_prompt_tokens: int | None = None  # keep only the last k prompt tokens
    # set by the engine from the tokenizer; users leave these alone
    eos_token_ids: list[int] = field(default_factory=list, repr=False)
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        self.bad_words = list(dict.fromkeys(self.bad_words or []))  # vLLM drops repeats too
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be an integer >= 1, got {self.n!r}")
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                bad(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                bad(f"{name} must be a finite number, got {value}")
            try:
                cast = as_float32(value)
            except OverflowError:
                bad(f"{name} is out of float32's range, got {value}")
            if value != 0 and cast == 0:
                bad(f"{name} is too small to be represented (rounds to 0 in float32), got {value}")
        if self.temperature < 0:
            bad(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("top_k", "min_tokens"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                bad(f"{name} must be an integer, got {getattr(self, name)!r}")
        if self.top_k < 0:
            bad(f"top_k must be 0 or -1 (off) or a positive integer, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if any(not s for s in self.stop):
            bad("stop strings must be non-empty")
        self._validate_token_fields(bad)

    def _validate_token_fields(self, bad) -> None:
        """logit_bias, allowed_token_ids, bad_words, best_of, truncate_prompt_tokens."""

        def token_id(t) -> bool:
            return isinstance(t, int) and not isinstance(t, bool) and t >= 0

        if self.logit_bias is not None:
            for t, b in self.logit_bias.items():
                if not token_id(t):
                    bad(f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
                if isinstance(b, bool) or not isinstance(b, int | float) or not math.isfinite(b):
                    bad(f"logit_bias values must be finite numbers, got {b!r} for token {t}")
                if not -LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE:
                    bad(f"logit_bias values must be in [-100, 100], got {b} for token {t}")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                bad("allowed_token_ids must not be empty (it would allow no token)")
            if not all(token_id(t) for t in self.allowed_token_ids):
                bad(f"allowed_token_ids must be token ids (integers >= 0), got {self.allowed_token_ids[:5]!r}")
        if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            bad("bad_words must be non-empty strings")
        if len(self.bad_words) > MAX_BAD_WORDS:
            bad(f"bad_words holds {len(self.bad_words)} words; at most {MAX_BAD_WORDS}")
        if self.best_of is not None:
            if isinstance(self.best_of, bool) or not isinstance(self.best_of, int) or self.best_of < 1:
                bad(f"best_of must be an integer >= 1, got {self.best_of!r}")
            if self.best_of < self.n:
                bad(f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}")
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            bad(f"truncate_prompt_tokens must be an integer >= 1, got {k!r}")

    @property
    def has_penalties(self) -> bool:
        """Repetition, frequency or presence penalty: the sampler must see the token history."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def reads_history(self) -> bool:
        """Does sampling read this row's earlier tokens (penalties, min_tokens, a bad word of more
        than one token)? Such a row cannot be sampled before the previous step's token is back on
        the host."""
        if self.has_penalties or self.min_tokens > 0:
            return True
        # checked per row every step: the common case (no bad words) must not build a generator
        return bool(self.bad_words_token_ids) and any(len(w) > 1 for w in self.bad_words_token_ids)

    @property
    def edits_logits(self) -> bool:
        """logit_bias, allowed_token_ids or bad_words: the sampler edits this row's logits first."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words_token_ids)

    @property
    def num_samples(self) -> int:
        """Sequences the engine runs for one prompt: best_of when set, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def ranks_samples(self) -> bool:
        """best_of > n: every sample's cumulative logprob is tracked, to return the n best."""
        return self.best_of is not None and self.best_of > self.n

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
