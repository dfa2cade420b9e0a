"""A StepInput as one int64 tensor, for the tensor-parallel workers (no pickling on the hot path).

A worker runs the same forward as the driver but never samples, so it needs only the batch layout
and what decides which logits are computed: the per-sequence lengths and block tables, the flat
ids, positions and slots, the sampled rows, the pending feeds, the prompt-logprob rows and the
further KV groups' tables. Sampling parameters, token histories and seeds stay on the driver.

The layout is a fixed schema of segments, each its length then its values, in `_FIELDS` order;
a ragged list of lists (block tables) is two segments, the lengths and the flattened values. The
driver broadcasts a two-int header first (kind, payload length), then the payload.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from atomc.runtime.batch import GroupTables, PromptLogprobRequest, StepInput

STEP, STOP = 1, 0  # header kinds: a step follows; the worker stops
HEADER_LEN = 2

# flat int lists of StepInput, in payload order
_FIELDS = (
    "seq_ids", "query_lens", "context_lens", "input_ids", "positions", "slot_mapping",
    "sample_rows", "sample_seq_ids", "feed_rows", "feed_sources", "masked_rows",
)  # fmt: skip


def encode(step: StepInput) -> torch.Tensor:
    """The worker's part of `step` as one int64 tensor."""
    parts: list[list[int]] = [[step.step_id, -1 if step.feed_step is None else step.feed_step]]
    parts += [getattr(step, name) for name in _FIELDS]
    parts += _ragged(step.block_tables)
    lp = step.prompt_logprobs
    parts.append([v for r in lp for v in (r.seq_id, r.first_row, r.top_n)])
    parts += _ragged([r.target_ids for r in lp])
    parts.append([len(step.group_tables)])
    for group in step.group_tables:
        parts += _ragged(group.block_tables)
        parts.append(group.slot_mapping)
    lens = np.fromiter(map(len, parts), np.int64, len(parts))
    flat = np.empty(int(lens.sum()) + len(parts), np.int64)
    # each segment is its length followed by its values
    starts = np.concatenate(([0], np.cumsum(lens + 1)[:-1]))
    flat[starts] = lens
    mask = np.ones(len(flat), bool)
    mask[starts] = False
    flat[mask] = np.fromiter(itertools.chain.from_iterable(parts), np.int64, int(lens.sum()))
    return torch.from_numpy(flat)


def header(kind: int, payload: torch.Tensor | None = None) -> torch.Tensor:
    return torch.tensor([kind, 0 if payload is None else payload.numel()], dtype=torch.int64)


def decode(payload: torch.Tensor) -> StepInput:
    """The StepInput a worker runs (no sampling parameters: the worker does not sample)."""
    reader = _Reader(payload.tolist())
    step_id, feed_step = reader.take()
    fields = {name: reader.take() for name in _FIELDS}
    tables = reader.ragged()
    triples = reader.take()
    targets = reader.ragged()
    prompt_lp = [
        PromptLogprobRequest(triples[3 * i], triples[3 * i + 1], triples[3 * i + 2], t) for i, t in enumerate(targets)
    ]
    (num_groups,) = reader.take()
    groups = []
    for _ in range(num_groups):
        group_tables = reader.ragged()
        groups.append(GroupTables(group_tables, reader.take()))
    if not reader.done:
        raise ValueError("step payload has trailing values: driver and worker disagree on the schema")
    return StepInput(
        step_id, fields["seq_ids"], fields["query_lens"], fields["context_lens"], tables,
        fields["input_ids"], fields["positions"], fields["slot_mapping"],
        fields["sample_rows"], fields["sample_seq_ids"], [],
        feed_rows=fields["feed_rows"], feed_sources=fields["feed_sources"],
        feed_step=None if feed_step < 0 else feed_step, prompt_logprobs=prompt_lp, group_tables=groups,
        masked_rows=fields["masked_rows"],
    )  # fmt: skip


def _ragged(rows: list[list[int]]) -> list[list[int]]:
    return [[len(r) for r in rows], list(itertools.chain.from_iterable(rows))]


class _Reader:
    def __init__(self, values: list[int]):
        self.values, self.at = values, 0

    def take(self) -> list[int]:
        n = self.values[self.at]
        out = self.values[self.at + 1 : self.at + 1 + n]
        self.at += 1 + n
        return out

    def ragged(self) -> list[list[int]]:
        lens, flat = self.take(), self.take()
        bounds = itertools.accumulate(lens, initial=0)
        return [flat[a:b] for a, b in itertools.pairwise(bounds)]

    @property
    def done(self) -> bool:
        return self.at == len(self.values)
