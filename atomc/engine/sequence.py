"""A sequence being generated, and the request that owns its `n` samples."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from atomc.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    params: SamplingParams
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache (or queued on the GPU to be)
    # tokens sampled by launched steps whose values have not been read back yet (async scheduling):
    # they follow token_ids, and a step that takes one as input gets it on the GPU
    num_pending: int = 0
    # the first pending token's row among the in-flight launch's sampled rows (the others follow)
    pending_row: int = 0
    max_num_tokens: int = 2**62  # prompt + max_tokens, capped by max_model_len: it finishes there
    # the first KV-cache group's block ids by position: block_tables[0], the same list (the hot
    # paths read it without indexing; the scheduler sets both, see set_block_tables)
    block_table: list[int] = field(default_factory=list)
    # per KV-cache group (one block pool each, atomc/kv_spec.py: kv_cache_groups), the block ids
    # by position; a sliding-window group's first `released_blocks[g]` entries were freed behind
    # the window and hold its null block
    block_tables: list[list[int]] = field(default_factory=list)
    released_blocks: list[int] = field(default_factory=lambda: [0])
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the full, committed blocks
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first schedule)
    scheduled_once: bool = False
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=lambda: [None])  # none for token 0
    cumulative_logprob: float = 0.0
    text: str = ""
    # structured outputs: this sequence's grammar matcher (engine/structured_outputs.py), else None
    grammar: Any = None

    def __post_init__(self) -> None:
        if not self.block_tables:
            self.block_tables = [self.block_table]

    def set_block_tables(self, tables: list[list[int]]) -> None:
        """Replace the tables of every group (and the first group's alias `block_table`)."""
        self.block_tables = tables
        self.block_table = tables[0]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def finishes_on_pending(self) -> bool:
        """True when the tokens already sampled reach the length limit: nothing more to schedule."""
        return self.num_tokens + self.num_pending >= self.max_num_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
