"""Block manager: allocation, ref counts, chained prefix hashes, LRU eviction of free cached blocks."""

from __future__ import annotations

import pytest

from atomc.engine.block_manager import BlockManager, block_hash


def fill(bm: BlockManager, tokens: list[int]) -> list[int]:
    """Allocate and commit full blocks for `tokens` as the scheduler would."""
    table, parent = [], None
    for start in range(0, len(tokens), bm.block_size):
        b = bm.allocate()
        table.append(b)
        chunk = tokens[start : start + bm.block_size]
        if len(chunk) == bm.block_size:
            parent = bm.commit_full_block(b, parent, chunk)
    return table


def test_allocate_and_free_counts():
    bm = BlockManager(num_blocks=4, block_size=4)
    ids = [bm.allocate() for _ in range(4)]
    assert sorted(ids) == [0, 1, 2, 3] and bm.num_free_blocks == 0 and bm.usage() == 1.0
    with pytest.raises(RuntimeError):
        bm.allocate()
    bm.free_blocks(ids)
    assert bm.num_free_blocks == 4
    with pytest.raises(AssertionError):
        bm.free_blocks([ids[0]])


def test_hash_is_chained_over_the_prefix():
    a = block_hash(None, [1, 2])
    assert block_hash(a, [3, 4]) != block_hash(block_hash(None, [9, 9]), [3, 4])
    assert block_hash(a, [3, 4]) == block_hash(block_hash(None, [1, 2]), [3, 4])


def test_prefix_match_shares_blocks_and_counts_refs():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    table = fill(bm, tokens)
    hits = bm.match_prefix(tokens[:8] + [99, 98, 97, 96])
    assert hits == table[:2]
    bm.take_cached(hits)
    assert bm.blocks[table[0]].ref_count == 2
    assert bm.match_prefix([0, 1, 2, 3, 7, 7, 7, 7]) == table[:1]  # diverges in block 2
    assert bm.match_prefix([5, 1, 2, 3]) == []


def test_freed_cached_blocks_revive_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    t1 = fill(bm, [1, 2, 3, 4])  # two cached blocks
    bm.free_blocks(t1)
    assert bm.num_free_blocks == 4
    assert bm.match_prefix([1, 2, 3, 4, 5]) == t1  # still cached while free
    bm.take_cached(t1[:1])
    assert bm.num_free_blocks == 3 and bm.blocks[t1[0]].ref_count == 1
    bm.free_blocks(t1[:1])
    # uncached blocks go first, then the oldest cached one: allocate 3 -> t1's tail block is evicted
    got = [bm.allocate() for _ in range(3)]
    assert t1[1] in got and t1[0] not in got
    assert bm.match_prefix([1, 2, 3, 4, 5]) == [t1[0]]


def test_prefix_caching_off_never_matches():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    fill(bm, [1, 2, 3, 4])
    assert bm.match_prefix([1, 2, 3, 4]) == []
