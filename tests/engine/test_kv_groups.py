"""KV-cache groups in the scheduler (engine/scheduler.py, engine/block_manager.py): a full-attention
pool next to a sliding-window pool, each with a block table per sequence. The windowed pool frees a
sequence's blocks once they lie wholly behind the window of the chunk being computed (leaving its
null block in their entries), holds at most ceil((W - 1 + chunk) / block) + 1 live blocks per
sequence, and a prefix hit must hold in both pools. No model runs: the scheduler is driven step by
step as the engine drives it."""

from __future__ import annotations

import pytest

from atomc import SamplingParams
from atomc.config import SchedulerConfig
from atomc.engine.block_manager import NULL_BLOCK, BlockManager
from atomc.engine.scheduler import Scheduler
from atomc.engine.sequence import Sequence
from atomc.engine.step_input import build_step_input

BS, W = 4, 8


def seq(i: int, prompt: list[int], max_tokens: int = 6) -> Sequence:
    s = Sequence(i, str(i), 0, list(prompt), len(prompt), SamplingParams(max_tokens=max_tokens))
    s.max_num_tokens = len(prompt) + max_tokens
    return s


def pools(full: int = 64, window: int = 16, prefix: bool = True, w: int = W) -> list[BlockManager]:
    return [BlockManager(full, BS, prefix), BlockManager(window, BS, prefix, sliding_window=w)]


def live(s: Sequence, g: int = 1) -> list[int]:
    return s.block_tables[g][s.released_blocks[g] :]


def check_tables(sched: Scheduler, scheduled, chunk: int) -> None:
    """Invariants of the scheduled sequences' tables right after scheduling."""
    full, window = sched.groups
    for s in (item.seq for item in scheduled):
        t_full, t_win = s.block_tables
        assert len(t_full) == len(t_win)
        released = s.released_blocks[1]
        assert t_win[:released] == [NULL_BLOCK] * released
        assert NULL_BLOCK not in live(s)  # the null block is never handed out
        assert released == window.first_live_block(s.num_computed_tokens)  # released as soon as behind
        assert len(live(s)) <= -(-(W - 1 + chunk) // BS) + 1
        assert all(full.blocks[b].ref_count > 0 for b in t_full)
        assert all(window.blocks[b].ref_count > 0 for b in live(s))


def run(sched: Scheduler, seqs: list[Sequence], chunk: int, budget_per_step=None) -> dict[int, list[int]]:
    """Drive `sched` until every sequence finishes; a sampled token is a function of the sequence
    and its position, so a run's tokens do not depend on scheduling. Returns the outputs."""
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.running or sched.waiting:
        if budget_per_step is not None:
            sched.config.max_num_batched_tokens = budget_per_step(steps)
        scheduled = sched.schedule()
        assert scheduled, "no progress"
        check_tables(sched, scheduled, chunk)
        samplers = [item.seq for item in scheduled if item.samples]
        build_step_input(scheduled, BS, steps, None, [], num_groups=len(sched.groups))
        sched.commit_computed(scheduled)
        for s in samplers:
            s.token_ids.append(100 + (s.seq_id * 31 + s.num_tokens) % 97)
            if s.num_tokens >= s.max_num_tokens:
                sched.finish(s, "length")
        steps += 1
        assert steps < 1000
    return {s.seq_id: s.output_token_ids for s in seqs}


def assert_all_free(sched: Scheduler) -> None:
    for g in sched.groups:
        assert g.num_free_blocks == g.num_usable_blocks
        assert all(b.ref_count == 0 for b in g.blocks)


@pytest.mark.parametrize("chunk", [3, 8, 64])
def test_windowed_pool_keeps_only_the_window(chunk):
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=chunk), pools())
    a, b = seq(0, list(range(10, 50)), max_tokens=20), seq(1, list(range(60, 93)), max_tokens=9)
    run(sched, [a, b], chunk)
    assert a.num_computed_tokens == 0  # released
    assert_all_free(sched)


def test_release_at_the_window_edge_keeps_the_first_querys_keys():
    # W = 8, blocks of 4: a chunk starting at 12 reads keys from 5 (block 1), one at 13 from 6,
    # one at 16 from 9 (block 2): blocks are released only once wholly before the first key
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=12), pools())
    s = seq(0, list(range(10, 40)))
    sched.add(s)
    sched.commit_computed(sched.schedule())  # positions 0..11
    assert s.released_blocks[1] == 0
    for budget, begin, released in [(1, 12, 1), (3, 13, 1), (4, 16, 2), (1, 20, 3)]:
        sched.config.max_num_batched_tokens = budget
        (item,) = sched.schedule()
        assert s.num_computed_tokens == begin and s.released_blocks[1] == released
        first_key = begin - W + 1
        assert released * BS <= first_key < (released + 1) * BS  # the block of the first key stays
        step, _ = build_step_input([item], BS, 0, None, [], num_groups=2)
        (group,) = step.group_tables
        assert group.block_tables == [s.block_tables[1]]
        want = [s.block_tables[1][p // BS] * BS + p % BS for p in range(begin, begin + budget)]
        assert group.slot_mapping == want and all(slot >= BS for slot in want)  # never the null block
        assert step.slot_mapping == [s.block_tables[0][p // BS] * BS + p % BS for p in range(begin, begin + budget)]
        sched.commit_computed([item])
    window_pool = sched.groups[1]
    free_before, live_blocks = window_pool.num_free_blocks, len(live(s))
    assert window_pool.num_usable_blocks - free_before == live_blocks  # the released ones are back
    sched.finish(s, "abort")
    assert window_pool.num_free_blocks == free_before + live_blocks
    assert_all_free(sched)


def test_preemption_by_the_windowed_pool_and_resume():
    # 7 usable window blocks: one sequence in prefill holds up to 5, so two cannot both prefill
    # and the newest is preempted; every sequence still completes with the same tokens
    chunk = 8
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16)
    prompts = [list(range(10, 40)), list(range(50, 75)), list(range(80, 100))]
    ref_sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=chunk), pools(window=32))
    ref = run(ref_sched, [seq(i, p, 12) for i, p in enumerate(prompts)], chunk)
    sched = Scheduler(cfg, pools(window=8))
    sched.config.max_num_batched_tokens = chunk
    got = run(sched, [seq(i, p, 12) for i, p in enumerate(prompts)], chunk)
    assert sched.num_preemptions > 0
    assert got == ref
    assert_all_free(sched)


def test_full_pool_preempts_too_and_nothing_leaks():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8), pools(full=14, window=32))
    out = run(sched, [seq(i, list(range(10 + i, 30 + i)), 10) for i in range(3)], 8)
    assert sched.num_preemptions > 0 and all(len(o) == 10 for o in out.values())
    assert_all_free(sched)


def evict(pool: BlockManager, h: bytes) -> None:
    """Drop one cached block from a pool's prefix cache (what allocation does to the LRU's oldest)."""
    block = pool.blocks[pool.cached.pop(h)]
    block.hash = None


def cached_run(prompt: list[int]) -> tuple[Scheduler, Sequence]:
    """A scheduler whose pools cache `prompt`'s blocks (its sequence ran and finished)."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), pools())
    a = seq(0, prompt, max_tokens=1)
    run(sched, [a], 64)
    return sched, a


PROMPT = list(range(10, 34))  # 24 tokens: 6 full blocks


@pytest.mark.parametrize(
    "pool, block, hit",
    [
        (None, None, 6),  # everything cached: the longest hit
        (1, 5, 5),  # the window pool lost block 5: a hit of 5 needs blocks 3, 4 only
        (1, 0, 6),  # lost block 0, long behind the window: the hit of 6 (needs blocks 4, 5) stands
        (1, 4, 4),  # lost block 4: 6 and 5 both read it; 4 needs blocks 2, 3
        (0, 2, 2),  # the full pool lost block 2: at most 2, whose window is blocks 0, 1
    ],
)
def test_prefix_hit_must_hold_in_every_pool(pool, block, hit):
    sched, _ = cached_run(PROMPT)
    b = seq(1, PROMPT + [7, 7, 7, 7, 7])
    k, chain = sched._match_groups(b.token_ids, (b.num_tokens - 1) // BS)
    assert k == 6 and len(chain) == 6
    if pool is not None:
        evict(sched.groups[pool], chain[block])
    sched.add(b)
    sched.schedule()
    assert b.num_computed_tokens == hit * BS == b.num_cached_tokens
    full_table, win_table = b.block_tables
    assert full_table[:hit] == [sched.groups[0].cached[h] for h in chain[:hit]]
    first = sched.groups[1].first_live_block(hit * BS)
    assert b.released_blocks[1] == first and win_table[:first] == [NULL_BLOCK] * first
    assert win_table[first:hit] == [sched.groups[1].cached[h] for h in chain[first:hit]]
    assert b.block_hashes == chain[:hit]
    sched.finish(b, "abort")
    assert_all_free(sched)


def test_window_hit_check_is_not_monotonic():
    # two windowed pools that disagree: each lowers the candidate in turn until one length suits
    # all; a single pass would stop at a hit whose window one pool lacks
    prompt = list(range(10, 42))  # 8 blocks
    groups = pools() + [BlockManager(32, BS, True, sliding_window=5)]
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), groups)
    a = seq(0, prompt, 1)
    sched.add(a)
    sched.commit_computed(sched.schedule())  # the whole prompt in one step
    sched.finish(a, "length")
    b = seq(1, prompt + [1])
    k, chain = sched._match_groups(b.token_ids, 8)
    assert k == 8
    # W 8 (pool 1): a hit of k reads blocks (4k - 7) // 4 .. k - 1; W 5 (pool 2): block k - 1 only
    evict(groups[1], chain[7])  # pool 1: 8 no, 7 (blocks 5, 6) yes
    evict(groups[2], chain[6])  # pool 2 at 7: no; 6 (block 5): no; 5 (block 4): yes
    evict(groups[2], chain[5])
    evict(groups[1], chain[3])  # pool 1 at 5 (blocks 3, 4): no; 4 (2, 3): no; 3 (1, 2): yes
    k, _ = sched._match_groups(b.token_ids, 8)
    assert k == 3
    for g in groups:  # and a hit of 3 is served by every pool
        first = g.first_live_block(3 * BS)
        assert all(h in g.cached for h in chain[first:3])
