"""The batch sizes the runtime captures decode CUDA graphs at (`--cudagraph-capture-sizes`).

A runtime policy, not a compile factor: the compiled graph is shape-generic (the token dim is
unbacked), so one artifact serves every set of capture sizes.
"""

from __future__ import annotations


def default_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """1, 2, 4, then every 8 up to the largest decode batch (a decode step is one token a sequence)."""
    top = max(1, min(max_num_seqs, max_num_batched_tokens))
    ladder = [1, 2, 4] + list(range(8, top + 1, 8))
    return sorted({s for s in ladder if s <= top} | {top})


def resolve_capture_sizes(sizes: list[int] | None, max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """The sizes asked for (sorted, deduplicated, checked), or the default ladder."""
    if sizes is None:
        return default_capture_sizes(max_num_seqs, max_num_batched_tokens)
    bad = [s for s in sizes if s < 1 or s > max_num_batched_tokens]
    if bad:
        raise ValueError(f"--cudagraph-capture-sizes {bad} outside 1..{max_num_batched_tokens} (max tokens)")
    return sorted(set(sizes))
