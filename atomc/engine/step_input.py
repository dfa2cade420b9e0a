"""The engine's side of the step record: one `StepInput` from the scheduler's output.

The runner reads nothing of the engine's `Sequence` objects, so everything it needs is copied out
here: per sequence its query and context lengths and block table; the flat input ids (a token
sampled by the in-flight launch and not read back yet is marked pending and fed on the device),
positions and KV slots; the sampled rows with their parameters, token histories for the rows that
read them, and seeds; the prompt rows to score. One pass over the scheduled sequences, lists
appended in place: this runs every step, and at hundreds of decoding sequences its cost is part of
the step's host time (benchmarks/engine_host_cpu.py). With several KV-cache groups (sliding-window
layers beside full ones, each group its own block pool) every further group adds its block tables
and KV slots (`StepInput.group_tables`); with one group none of that code runs.
"""

from __future__ import annotations

from atomc.engine.scheduler import ScheduledSeq
from atomc.engine.sequence import Sequence
from atomc.runtime.batch import PENDING_TOKEN, GroupTables, PromptLogprobRequest, StepInput, slots_for


def build_step_input(
    scheduled: list[ScheduledSeq],
    block_size: int,
    step_id: int,
    in_flight_step: int | None,
    finished_seq_ids: list[int],
    num_groups: int = 1,
) -> tuple[StepInput, list[Sequence]]:
    """The step record for `scheduled`, and the sequence of each sampled row (in row order).

    A sequence's pending tokens were sampled by launch `in_flight_step` (the only one not read back
    yet), at rows `seq.pending_row`, `seq.pending_row + 1`, ... of its sampled rows. Block tables
    and token histories are the sequences' own lists, not copies: the runner consumes the record
    at once (or pickles it), before the scheduler changes them. `num_groups`: the KV-cache groups
    (each sequence has a block table per group)."""
    seq_ids: list[int] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    tables: list[list[int]] = []
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    sample_seq_ids: list[int] = []
    params_list = []
    samplers: list[Sequence] = []
    history: dict[int, tuple[list[int], list[int]]] = {}
    seeds: dict[int, int] = {}
    feed_rows: list[int] = []
    feed_sources: list[int] = []
    prompt_logprobs: list[PromptLogprobRequest] = []
    masked: list[int] = []
    bs = block_size
    for item in scheduled:
        seq, n = item.seq, item.num_new_tokens
        begin = seq.num_computed_tokens
        end = begin + n
        tokens, table = seq.token_ids, seq.block_table
        known = len(tokens)
        row0 = len(ids)
        seq_ids.append(seq.seq_id)
        query_lens.append(n)
        context_lens.append(begin)
        tables.append(table)
        if n == 1:  # decode, the common case: no slices or ranges
            ids.append(tokens[begin] if begin < known else PENDING_TOKEN)
            positions.append(begin)
            slots.append(table[begin // bs] * bs + begin % bs)
        else:
            ids.extend(tokens[begin:end])
            positions.extend(range(begin, end))
            slots.extend(slots_for(table, begin, end, bs))
        if end > known:  # inputs sampled by the in-flight launch: filled in on the device
            if in_flight_step is None:
                raise RuntimeError(f"sequence {seq.seq_id}: pending tokens but no launch in flight")
            first = max(begin, known)
            if n != 1:
                ids.extend([PENDING_TOKEN] * (end - first))
            for p in range(first, end):
                feed_rows.append(row0 + p - begin)
                feed_sources.append(seq.pending_row + p - known)
        p = seq.params
        if end == known + seq.num_pending:  # the chunk reaches the last token: a new one is sampled
            k = len(sample_rows)
            sample_rows.append(row0 + n - 1)
            sample_seq_ids.append(seq.seq_id)
            params_list.append(p)
            samplers.append(seq)
            if p.reads_history:
                history[k] = (seq.prompt_token_ids, seq.output_token_ids)
            if p.seed is not None:
                seeds[k] = p.seed + seq.index  # sample i of n draws from seed + i
            if p.structured_outputs is not None:
                masked.append(k)
        if p.prompt_logprobs is not None:
            # the row at position j scores token j + 1, up to the last prompt token
            last = min(end, seq.num_prompt_tokens - 1)
            if last > begin:
                targets = tokens[begin + 1 : last + 1]
                prompt_logprobs.append(PromptLogprobRequest(seq.seq_id, row0, p.prompt_logprobs, targets))
    more = _group_tables(scheduled, num_groups, bs) if num_groups > 1 else []
    step = StepInput(
        step_id, seq_ids, query_lens, context_lens, tables, ids, positions, slots,
        sample_rows, sample_seq_ids, params_list, history, seeds,
        feed_rows, feed_sources, in_flight_step if feed_rows else None, prompt_logprobs, finished_seq_ids, more,
        masked,
    )  # fmt: skip
    return step, samplers


def _group_tables(scheduled: list[ScheduledSeq], num_groups: int, bs: int) -> list[GroupTables]:
    """Block tables and KV slots of the KV groups after the first (a pass of its own, so the
    one-group step above pays nothing for them)."""
    more = [GroupTables([], []) for _ in range(num_groups - 1)]
    for item in scheduled:
        seq = item.seq
        begin = seq.num_computed_tokens
        end = begin + item.num_new_tokens
        for group, table in zip(more, seq.block_tables[1:], strict=True):
            group.block_tables.append(table)
            group.slot_mapping.extend(slots_for(table, begin, end, bs))
    return more
