"""The batch sizes the runtime captures decode CUDA graphs at (`--cudagraph-capture-sizes`), and the
token counts its start-up forwards warm the kernels at.

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


def decode_graph_sizes(sizes: list[int] | None, max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """The decode batches the runner captures graphs at: the resolved sizes up to max_num_seqs."""
    return [s for s in resolve_capture_sizes(sizes, max_num_seqs, max_num_batched_tokens) if s <= max_num_seqs]


def warm_up_sizes(largest_graph: int, max_num_batched_tokens: int) -> list[int]:
    """Token counts a start-up forward runs at (model_runner.warm_up_prefill_sizes): the powers of two
    above the decode graphs' largest batch (whose capture compiles their sizes' kernels; from 1
    without graphs) and below the sizing forward's `max_num_batched_tokens` (which compiles its own).
    The tile files are keyed by powers of two, so every batch between them picks a variant compiled
    there, token counts being out of Triton's alignment classes (kernels/triton/specialize.py; decode
    attention, a kernel of its own, still compiles at the first decode step without graphs)."""
    sizes, t = [], 1 << max(0, largest_graph).bit_length()  # the first power of two above the graphs
    while t < max_num_batched_tokens:
        sizes.append(t)
        t *= 2
    return sizes
