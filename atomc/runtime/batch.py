"""The step record between the engine and the model runner, and the one attention-metadata builder.

`StepInput` is everything one step asks of a runner: the scheduled sequences (id, query length,
context length, block table), the flat batch (input ids, positions, KV slots), which flat rows are
sampled and how, the inputs still on the device from an earlier launch (pending feeds), the
prompt-logprob requests, and the sequences finished since the last step (so the runner drops what
it keeps per sequence, e.g. a seeded generator). It is plain data (ints, lists, SamplingParams,
no tensors, no engine objects), so it pickles: a tensor-parallel worker in another process can run
the same step. It is built every step, on the hot path of decode: hence parallel lists, not one
object per row, and sparse dicts for what few rows carry (token histories, seeds).

KV-cache groups: layers whose KV lives in separate block pools (sliding-window layers beside full
ones, `atomc/kv_spec.py: kv_cache_groups`) see other block ids for the same positions, so every group
after the first brings its own block tables and KV slots (`GroupTables`); the query layout and
lengths are shared. A dense model has one group and `group_tables` stays empty.

`StepResult` is what comes back: a token and its logprobs per sampled row, prompt logprobs per
sequence.

`write_batch_arrays` is the only place that turns a step into the arrays attention reads
(`AttentionMetadata`'s slot mapping, query starts, sequence lengths, block tables, and the slot
mapping and block tables of each further KV group) plus the input ids and positions. The eager
path writes them into fresh arrays and copies those to the device;
the CUDA-graph paths write them into their pinned staging buffers, padded to the captured shape.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from atomc.sampling_params import SamplingParams

PENDING_TOKEN = -1  # an out-of-range id: a pending input the device feed missed fails loudly


@dataclass
class PromptLogprobRequest:
    """Score prompt tokens: flat rows `first_row .. first_row + len(target_ids) - 1` of this step
    predict `target_ids` (the row at position p scores the token at p + 1); `top_n` more per row."""

    seq_id: int
    first_row: int
    top_n: int
    target_ids: list[int]


@dataclass
class GroupTables:
    """One further KV-cache group's view of the step: its block table per scheduled sequence (batch
    order) and the KV slot of each query row in its pool."""

    block_tables: list[list[int]]
    slot_mapping: list[int]


@dataclass
class StepInput:
    step_id: int
    # per scheduled sequence, in batch order (a sequence's query rows are contiguous, in this order)
    seq_ids: list[int]
    query_lens: list[int]  # tokens computed this step
    context_lens: list[int]  # tokens already in the KV cache before this step
    block_tables: list[list[int]]
    # per query row (flat)
    input_ids: list[int]  # PENDING_TOKEN where the id is fed on the device (feed_rows)
    positions: list[int]
    slot_mapping: list[int]
    # per sampled row, in flat order; a sequence may have several (speculative decoding's verify)
    sample_rows: list[int]  # flat row whose logits are sampled
    sample_seq_ids: list[int]
    sampling_params: list[SamplingParams]
    # sampled-row index -> (prompt ids, output ids), only for rows whose sampling reads them
    token_history: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)
    # sampled-row index -> seed, for seeded sequences: the runner keeps one generator per sequence
    seeds: dict[int, int] = field(default_factory=dict)
    # pending feeds: input row feed_rows[i] takes the token of sampled row feed_sources[i] of launch
    # `feed_step` (its sampled-row order), still on the device
    feed_rows: list[int] = field(default_factory=list)
    feed_sources: list[int] = field(default_factory=list)
    feed_step: int | None = None
    prompt_logprobs: list[PromptLogprobRequest] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    # KV-cache groups 1, 2, ...: their block tables and slots (group 0's are the fields above)
    group_tables: list[GroupTables] = field(default_factory=list)
    # sampled-row indices under structured outputs: their sampling waits for a token bitmask
    masked_rows: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    def uniform_query_len(self) -> int | None:
        """The query length every sequence shares, or None (also for an empty step)."""
        if not self.query_lens:
            return None
        q = self.query_lens[0]
        # sum == n * q with max == q means every length is q; both run in C
        return q if max(self.query_lens) == q and len(self.input_ids) == q * len(self.query_lens) else None


@dataclass
class StepResult:
    token_ids: list[int]  # per sampled row
    logprobs: list[dict[int, float] | None]  # per sampled row (None where not asked)
    prompt_logprobs: dict[int, list[dict[int, float]]] = field(default_factory=dict)  # seq id -> rows
    num_fallbacks: int = 0  # sampled rows with nothing left to draw from (see sampler.py)


def slots_for(table: list[int], begin: int, end: int, block_size: int) -> list[int]:
    """KV slots of positions begin..end-1 of a sequence with block table `table`."""
    return [table[p // block_size] * block_size + p % block_size for p in range(begin, end)]


def prefill_step_input(lengths: list[int], block_size: int) -> StepInput:
    """Whole prompts of token 0, each in fresh consecutive blocks, nothing sampled (profiling)."""
    seq_tables, ids, positions, slots, first = [], [], [], [], 0
    for n in lengths:
        table = list(range(first, first + (n + block_size - 1) // block_size))
        first += len(table)
        seq_tables.append(table)
        ids.extend([0] * n)
        positions.extend(range(n))
        slots.extend(slots_for(table, 0, n, block_size))
    zeros = [0] * len(lengths)
    return StepInput(0, list(range(len(lengths))), list(lengths), zeros, seq_tables, ids, positions, slots, [], [], [])


def group_array_name(name: str, group: int) -> str:
    """The array (or buffer) name of KV group `group`'s "slot_mapping" or "block_tables"."""
    return name if group == 0 else f"{name}_{group}"


def write_batch_arrays(
    step: StepInput,
    out: Mapping[str, np.ndarray],
    num_tokens: int,
    num_seqs: int,
    pad_query_len: int,
    query_start: bool = True,
) -> int:
    """Write the step's input ids, positions and attention metadata into host arrays `out`
    ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables", and
    for each further KV group g "slot_mapping_g", "block_tables_g"), padded to `num_tokens` rows and
    `num_seqs` sequences. Returns the block-table width written (equal in every group).

    Padding (CUDA graphs): rows past the step's get id 0, position 0 (RoPE reads its table at
    every row's position) and slot -1 (no KV write); sequences past the step's get
    `pad_query_len` query rows each and as many tokens of context, all in block 0, so their
    attention stays finite and is never read; with 0 they are empty and own no row.
    `query_start=False` leaves query_start_loc alone (the decode graphs keep it constant)."""
    t, b = len(step.input_ids), len(step.seq_ids)
    for name, values, pad in (
        ("input_ids", step.input_ids, 0),
        ("positions", step.positions, 0),
        ("slot_mapping", step.slot_mapping, -1),
    ):
        a = out[name]
        a[:t] = values
        a[t:num_tokens] = pad
    lens = out["seq_lens"]
    lens[:b] = step.context_lens
    lens[:b] += step.query_lens
    lens[b:num_seqs] = pad_query_len
    if query_start:
        starts = out["query_start_loc"]
        starts[0] = 0
        np.cumsum(step.query_lens, out=starts[1 : b + 1])
        starts[b + 1 : num_seqs + 1] = t + pad_query_len * np.arange(1, num_seqs - b + 1)
    width = _write_tables(step.block_tables, out["block_tables"], num_seqs)
    for g, group in enumerate(step.group_tables, 1):
        a = out[group_array_name("slot_mapping", g)]
        a[:t] = group.slot_mapping
        a[t:num_tokens] = -1
        _write_tables(group.block_tables, out[group_array_name("block_tables", g)], num_seqs)
    return width


def _write_tables(tables: list[list[int]], out: np.ndarray, num_seqs: int) -> int:
    """Rows of `out` for the first `num_seqs` sequences: each table, zero-padded (padded sequences
    all zeros) to the widest; returns that width."""
    b = len(tables)
    widths = np.fromiter(map(len, tables), np.int64, b)
    width = int(widths.max())
    bt = out[:num_seqs, :width]
    bt[:] = 0
    # one conversion of the flattened tables and a masked write: converting a list per row, or a
    # padded list of lists, costs about twice as much at hundreds of sequences
    mask = np.arange(width) < widths[:, None]
    bt[:b][mask] = np.fromiter(itertools.chain.from_iterable(tables), np.int32, int(widths.sum()))
    return width
