"""Continuous batching under a token budget, with chunked prefill and prefill+decode in one step.

Each step: running sequences first (one decode token, or the next prefill chunk), in arrival order,
then waiting ones while the token budget, `max_num_seqs` and free KV blocks allow. When a running
sequence needs a block and none is free, the most recently admitted sequence is preempted: its
blocks are freed and it goes back to the front of the queue to be recomputed (its full blocks
usually come straight back from the prefix cache).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from atomc.config import SchedulerConfig
from atomc.engine.block_manager import BlockManager
from atomc.engine.sequence import SeqStatus, Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the last token (known or pending), so a new token is sampled."""
        seq = self.seq
        return seq.num_computed_tokens + self.num_new_tokens == seq.num_tokens + seq.num_pending


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.finished_seq_ids: list[int] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def take_finished(self) -> list[int]:
        """Ids of the sequences finished since the last call (the runner frees their state)."""
        done, self.finished_seq_ids = self.finished_seq_ids, []
        return done

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.config.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.finishes_on_pending:
                i += 1  # its last token is on the GPU: it finishes when that is read back
                continue
            n = min(seq.num_tokens + seq.num_pending - seq.num_computed_tokens, budget)
            if not self._grow(seq, seq.num_computed_tokens + n):
                break  # seq itself was preempted: everything after it was preempted first
            out.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:
                break  # preempted with a token still on the GPU: its prompt is recomputed once it lands
            n = self._admit(seq, budget)
            if n == 0:
                break  # not enough free blocks: wait for running sequences to finish
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Take prefix-cache hits and blocks for a waiting sequence's first chunk; 0 if it does not fit."""
        bm = self.blocks
        # keep at least one token to compute, so the step yields logits for it
        hits = bm.match_prefix(seq.token_ids)[: (seq.num_tokens - 1) // bm.block_size]
        if seq.params.prompt_logprobs is not None:
            hits = []  # every prompt position must run through the model to be scored
        computed = len(hits) * bm.block_size
        n = min(seq.num_tokens - computed, budget)
        if not self.config.enable_chunked_prefill and n < seq.num_tokens - computed:
            return 0
        revived = sum(1 for b in hits if bm.blocks[b].ref_count == 0)
        fresh = bm.blocks_needed(computed + n) - len(hits)
        if not bm.can_allocate(revived + fresh):
            return 0
        bm.take_cached(hits)
        seq.block_table = list(hits)
        seq.block_hashes = [bm.blocks[b].hash for b in hits]
        seq.num_computed_tokens = computed
        if not seq.scheduled_once:
            seq.num_cached_tokens = computed
            bm.record_lookup(seq.num_prompt_tokens, computed)
            seq.scheduled_once = True
        for _ in range(fresh):
            seq.block_table.append(bm.allocate())
        return n

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` blocks for `num_tokens`, preempting the newest running sequences if needed."""
        need = self.blocks.blocks_needed(num_tokens) - len(seq.block_table)
        while not self.blocks.can_allocate(need):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        for _ in range(need):
            seq.block_table.append(self.blocks.allocate())
        return True

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        seq.prompt_logprobs = [None]  # recomputed from the start with the prompt
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def commit_computed(self, scheduled: list[ScheduledSeq]) -> None:
        """Once the forward is queued: advance computed counts and put newly full blocks in the
        prefix cache (only blocks whose tokens are all known: a pending token has no value yet)."""
        bs = self.blocks.block_size
        for item in scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            while len(seq.block_hashes) < min(seq.num_computed_tokens, seq.num_tokens) // bs:
                j = len(seq.block_hashes)
                parent = seq.block_hashes[-1] if seq.block_hashes else None
                h = self.blocks.commit_full_block(seq.block_table[j], parent, seq.token_ids[j * bs : (j + 1) * bs])
                seq.block_hashes.append(h)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.finished_seq_ids.append(seq.seq_id)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free_blocks(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
