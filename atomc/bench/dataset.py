"""Random prompts made of token ids, the shape of vLLM's `--dataset-name random`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive [low, high] for a length drawn around `length`, as vLLM does; never below 1 token."""
    low = max(1, math.floor(length * (1 - range_ratio)))
    high = max(low, math.ceil(length * (1 + range_ratio)))
    return low, high


def sample_random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    vocab_size: int = 1000,
    seed: int = 0,
    low_token_id: int = 0,
) -> list[BenchRequest]:
    """`num_prompts` prompts of random token ids in [low_token_id, vocab_size).

    Token ids go straight to the server, so no tokenizer is needed here and the prompt
    length is exact (a decoded-then-re-encoded text prompt would drift)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio}")
    if not 0 <= low_token_id < vocab_size:
        raise ValueError(f"need 0 <= low_token_id < vocab_size, got {low_token_id} and {vocab_size}")
    rng = np.random.default_rng(seed)
    in_low, in_high = length_bounds(input_len, range_ratio)
    out_low, out_high = length_bounds(output_len, range_ratio)
    input_lens = rng.integers(in_low, in_high + 1, size=num_prompts)
    output_lens = rng.integers(out_low, out_high + 1, size=num_prompts)
    return [
        BenchRequest(
            prompt_ids=rng.integers(low_token_id, vocab_size, size=int(n_in)).tolist(),
            output_len=int(n_out),
        )
        for n_in, n_out in zip(input_lens, output_lens, strict=True)
    ]
