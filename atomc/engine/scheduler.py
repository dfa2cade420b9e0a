"""Continuous batching under a token budget, with chunked prefill and prefill+decode in one step.

Each step: running sequences first (one decode token, or the next prefill chunk), in arrival order,
then waiting ones while the token budget, `max_num_seqs` and free KV blocks allow. When a running
sequence needs a block and none is free, the most recently admitted sequence is preempted: its
blocks are freed and it goes back to the front of the queue to be recomputed (its full blocks
usually come straight back from the prefix cache).

KV-cache groups (`atomc/kv_spec.py: kv_cache_groups`): each group of layers has its own block pool
(a `BlockManager`) and each sequence one block table per group. A sliding-window group releases a
sequence's blocks once they fall wholly behind the window of the chunk being computed, so its
tables hold only about (window + chunk) / block_size live blocks; admission and growth check every
pool, and a prefix hit must hold in each (see `_match_groups`). With one full-attention group (a
dense model) the original one-pool code runs, unchanged.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from atomc.config import SchedulerConfig
from atomc.engine.block_manager import NULL_BLOCK, BlockManager, block_hash
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
    def __init__(self, config: SchedulerConfig, blocks: BlockManager | list[BlockManager], micro_batches: int = 1):
        """`blocks`: the block pool, or one per KV-cache group (full attention first).

        `micro_batches` > 1 (pipeline stages): that many steps may be in flight at once, each of
        different sequences. A sequence whose sampled token is in flight is not scheduled again (that
        token exists only once its step has passed every stage; with one micro-batch it is fed on
        the device instead), and a step takes about 1 / micro_batches of the sequences, so the
        next steps have sequences of their own and the stages work at once."""
        self.config = config
        self.micro_batches = micro_batches
        self.schedule_in_flight = micro_batches == 1
        self.groups = list(blocks) if isinstance(blocks, list | tuple) else [blocks]
        self.blocks = self.groups[0]
        if len({g.block_size for g in self.groups}) != 1:
            raise ValueError("every KV-cache group must use the same block size")
        # one full-attention pool: the plain path (no windows, no per-group loops)
        self.single_pool = len(self.groups) == 1 and self.blocks.sliding_window is None
        if not self.single_pool:  # chosen once: _grow runs for every running sequence every step
            self._grow = self._grow_groups
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
        max_seqs = self._step_seq_limit()
        i = 0
        while i < len(self.running) and budget > 0 and len(out) < max_seqs:
            seq = self.running[i]
            if seq.finishes_on_pending or (seq.num_pending and not self.schedule_in_flight):
                i += 1  # its last token is on the GPU: it finishes (or goes on) when that is read back
                continue
            n = min(seq.num_tokens + seq.num_pending - seq.num_computed_tokens, budget)
            if not self._grow(seq, seq.num_computed_tokens + n):
                break  # seq itself was preempted: everything after it was preempted first
            out.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and len(out) < max_seqs:
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

    def _step_seq_limit(self) -> int:
        """The most sequences one step takes: all of them, or with micro-batches an equal share of
        the sequences that run or could be admitted."""
        if self.micro_batches == 1:
            return self.config.max_num_seqs
        active = min(len(self.running) + len(self.waiting), self.config.max_num_seqs)
        return max(1, -(-active // self.micro_batches))

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Take prefix-cache hits and blocks for a waiting sequence's first chunk; 0 if it does not fit."""
        if not self.single_pool:
            return self._admit_groups(seq, budget)
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
        table = list(hits)
        seq.set_block_tables([table])
        seq.block_hashes = [bm.blocks[b].hash for b in hits]
        self._start(seq, computed)
        for _ in range(fresh):
            table.append(bm.allocate())
        return n

    def _start(self, seq: Sequence, computed: int) -> None:
        seq.num_computed_tokens = computed
        if not seq.scheduled_once:
            seq.num_cached_tokens = computed
            self.blocks.record_lookup(seq.num_prompt_tokens, computed)
            seq.scheduled_once = True

    def _admit_groups(self, seq: Sequence, budget: int) -> int:
        """`_admit` over several pools: a hit of k blocks needs, in every pool, the blocks the next
        query reads (all k for full attention, the window's last ones for a sliding window)."""
        bs = self.blocks.block_size
        k, hashes = 0, []
        if seq.params.prompt_logprobs is None:
            k, hashes = self._match_groups(seq.token_ids, (seq.num_tokens - 1) // bs)
        computed = k * bs
        n = min(seq.num_tokens - computed, budget)
        if not self.config.enable_chunked_prefill and n < seq.num_tokens - computed:
            return 0
        fresh = self.blocks.blocks_needed(computed + n) - k
        plans = []
        for g in self.groups:
            first = g.first_live_block(computed)  # the blocks before it are not needed at all
            hits = [g.cached[h] for h in hashes[first:k]]
            revived = sum(1 for b in hits if g.blocks[b].ref_count == 0)
            if not g.can_allocate(revived + fresh):
                return 0
            plans.append((first, hits))
        tables, seq.released_blocks = [], []
        for g, (first, hits) in zip(self.groups, plans, strict=True):
            g.take_cached(hits)
            table = [NULL_BLOCK] * first + hits
            table.extend(g.allocate() for _ in range(fresh))
            tables.append(table)
            seq.released_blocks.append(first)
        seq.set_block_tables(tables)
        seq.block_hashes = hashes[:k]
        self._start(seq, computed)
        return n

    def _match_groups(self, token_ids: list[int], limit: int) -> tuple[int, list[bytes]]:
        """The longest prefix hit, in blocks (at most `limit`), that every pool serves, and the
        chained hashes of the prompt's first blocks (at least that many).

        The full-attention pools must hold every block of the hit, so hashing stops where they miss;
        a windowed pool must hold the blocks covering the last W - 1 positions before the hit. The
        windowed checks are not monotonic (a shorter hit has another window), so each pool lowers
        the candidate in turn until all agree; 0 always does."""
        if not self.blocks.enable_prefix_caching:
            return 0, []
        bs = self.blocks.block_size
        full = [g.cached for g in self.groups if g.sliding_window is None]
        hashes: list[bytes] = []
        parent = None
        for j in range(limit):
            parent = block_hash(parent, token_ids[j * bs : (j + 1) * bs])
            if any(parent not in cached for cached in full):
                break
            hashes.append(parent)
        windowed = [g for g in self.groups if g.sliding_window is not None]
        k, settled = len(hashes), False
        while not settled:
            settled = True
            for g in windowed:
                hit = g.window_hit_blocks(hashes, k)
                if hit < k:
                    k, settled = hit, False
        return k, hashes

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` blocks for `num_tokens`, preempting the newest running sequences if needed
        (one full-attention pool; `_grow_groups` replaces it for several)."""
        need = self.blocks.blocks_needed(num_tokens) - len(seq.block_table)
        while not self.blocks.can_allocate(need):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        for _ in range(need):
            seq.block_table.append(self.blocks.allocate())
        return True

    def _grow_groups(self, seq: Sequence, num_tokens: int) -> bool:
        """`_grow` over several pools: windowed pools first release the blocks behind the window of
        the chunk starting at `seq.num_computed_tokens` (its first query's W - 1 keys before it stay)."""
        begin, groups, tables = seq.num_computed_tokens, self.groups, seq.block_tables
        released = seq.released_blocks
        for i, g in enumerate(groups):
            if g.sliding_window is not None:
                released[i] = g.release_behind_window(tables[i], released[i], begin)
        need = self.blocks.blocks_needed(num_tokens) - len(tables[0])  # equal lengths in every group
        while not all(g.can_allocate(need) for g in groups):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        for g, table in zip(groups, tables, strict=True):
            for _ in range(need):
                table.append(g.allocate())
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
        single = self.single_pool
        for item in scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            while len(seq.block_hashes) < min(seq.num_computed_tokens, seq.num_tokens) // bs:
                j = len(seq.block_hashes)
                parent = seq.block_hashes[-1] if seq.block_hashes else None
                tokens = seq.token_ids[j * bs : (j + 1) * bs]
                if single:
                    h = self.blocks.commit_full_block(seq.block_table[j], parent, tokens)
                else:
                    h = block_hash(parent, tokens)
                    for g, table, released in zip(self.groups, seq.block_tables, seq.released_blocks, strict=True):
                        if j >= released:  # a block released behind the window is not cached
                            g.commit_hash(table[j], h)
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
        if self.single_pool:
            self.blocks.free_blocks(seq.block_table)
            seq.set_block_tables([[]])
        else:
            for g, table, released in zip(self.groups, seq.block_tables, seq.released_blocks, strict=True):
                g.free_blocks(table[released:])
            seq.set_block_tables([[] for _ in self.groups])
            seq.released_blocks = [0] * len(self.groups)
        seq.block_hashes = []
        seq.num_computed_tokens = 0
