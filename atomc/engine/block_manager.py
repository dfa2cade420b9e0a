"""Paged KV-cache bookkeeping: block allocation, prefix caching and block tables.

Prefix caching: a full block is identified by a hash chained over every token before it
(hash(prev_hash, tokens)), so equal hashes mean equal prefixes. Blocks are ref-counted; a block
whose count drops to zero keeps its contents and hash and waits in an LRU list, where a later
request can revive it (a hit) until allocation needs the space and evicts the oldest.

One manager is one block pool: the blocks of one KV-cache group (`atomc/kv_spec.py:
kv_cache_groups`). A sliding-window group's pool keeps block 0 out of allocation as its *null
block*: the entries of a sequence's table for blocks already released behind the window hold it,
so the table still indexes blocks by position while the attention kernels, which start at the
window, never read them (block 0 holds zeros: never allocated, never written).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass


def block_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(b",".join(str(t).encode() for t in tokens))
    return h.digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once the block is full and its tokens are final


NULL_BLOCK = 0  # a windowed pool's placeholder for released blocks (see the module docstring)


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, sliding_window: int | None = None
    ):
        first = 0 if sliding_window is None else NULL_BLOCK + 1
        if num_blocks < first + 1:
            raise ValueError("the KV cache needs at least one block" + (" besides the null block" if first else ""))
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window  # tokens; None: a full-attention pool
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free blocks in eviction order: never-used/evicted first, then cached ones oldest-first
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(first, num_blocks))
        self.num_usable_blocks = num_blocks - first
        self.cached: dict[bytes, int] = {}  # full-block hash -> block id
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which served from the cache

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # -- prefix cache ------------------------------------------------------------------------------

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Block ids of the longest cached chain of full blocks that prefixes `token_ids` (no side effects)."""
        if not self.enable_prefix_caching:
            return []
        hits, parent = [], None
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = block_hash(parent, token_ids[start : start + self.block_size])
            block_id = self.cached.get(parent)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # -- allocation --------------------------------------------------------------------------------

    def can_allocate(self, num_new_blocks: int) -> bool:
        return num_new_blocks <= self.num_free_blocks

    def take_cached(self, block_ids: list[int]) -> None:
        """Share blocks found by match_prefix: one more reference each; revived blocks leave the free list."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1

    def allocate(self) -> int:
        if not self.free:
            raise RuntimeError("KV cache out of blocks (the scheduler should have preempted)")
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evicting a cached block: forget its contents
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash = None
        block.ref_count = 1
        return block_id

    def free_blocks(self, block_ids: list[int]) -> None:
        # release in reverse so a sequence's tail blocks are evicted before its (more shareable) head
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed twice"
            if block.ref_count == 0:
                if block.hash is None:
                    self.free[block_id] = None
                    self.free.move_to_end(block_id, last=False)  # uncached blocks are reused first
                else:
                    self.free[block_id] = None  # cached: most recently used, evicted last

    def commit_full_block(self, block_id: int, parent: bytes | None, tokens: list[int]) -> bytes:
        """Record a now-full block in the prefix cache; returns its chained hash."""
        h = block_hash(parent, tokens)
        self.commit_hash(block_id, h)
        return h

    def commit_hash(self, block_id: int, h: bytes) -> None:
        """Record a now-full block whose chained hash is `h` in the prefix cache."""
        if self.enable_prefix_caching:
            block = self.blocks[block_id]
            if block.hash is None:
                block.hash = h
                self.cached.setdefault(h, block_id)

    # -- sliding window ----------------------------------------------------------------------------

    def first_live_block(self, begin: int) -> int:
        """Index (in a sequence's table) of the first block a chunk starting at position `begin`
        reads: its first query sees keys from begin - W + 1. Blocks before it can be released."""
        if self.sliding_window is None:
            return 0
        return max(0, begin - self.sliding_window + 1) // self.block_size

    def release_behind_window(self, table: list[int], released: int, begin: int) -> int:
        """Free the blocks of `table` wholly before the window of a chunk starting at `begin` (from
        index `released`, the count already released), leaving the null block in their entries.
        Returns the new released count."""
        first = self.first_live_block(begin)
        if first <= released:
            return released
        self.free_blocks(table[released:first])
        table[released:first] = [NULL_BLOCK] * (first - released)
        return first

    def window_hit_blocks(self, hashes: list[bytes], limit: int) -> int:
        """The largest k <= `limit` such that a sequence whose first k blocks have chained hashes
        `hashes[:k]` finds, in this pool, every block its next query's window reads (the blocks
        covering positions k*bs - W + 1 .. k*bs - 1); 0 always qualifies."""
        if not self.enable_prefix_caching:
            return 0
        cached, run = self.cached, 0
        runs = []  # runs[j]: cached blocks in a row ending at block j
        for h in hashes[:limit]:
            run = run + 1 if h in cached else 0
            runs.append(run)
        for k in range(len(runs), 0, -1):
            if runs[k - 1] >= k - self.first_live_block(k * self.block_size):
                return k
        return 0

    def record_lookup(self, queried: int, hit: int) -> None:
        self.prefix_queries += queried
        self.prefix_hits += hit
