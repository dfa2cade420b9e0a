"""Row-wise argmax for a few rows of a wide row (greedy sampling over a vocabulary), in two stages.

torch's argmax reduces one row in one thread block, so a decode step's single row of 128K logits
runs on one SM. Here stage 1 splits every row into CHUNK-wide chunks, one program each, and writes
a (max, first index) partial per chunk; stage 2 merges a row's partials in one small program.

Semantics are torch.argmax(dim=-1)'s on CUDA and CPU: the first index of the maximum; NaN counts
as larger than everything (the first NaN wins); -0.0 ties with 0.0; a row of -inf gives 0. Chunks
are merged in index order, so "first" holds across chunks too. No host sync: it can be queued in an
asynchronous step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomc.kernels.triton import pdl
from atomc.kernels.triton.pdl import after_producer

CHUNK = 1024  # elements per stage-1 program: 126 programs for one row of Llama-3's 128,256 logits
# From this many rows on, argmax_rows hands over to torch.argmax: torch's one block per row then
# already covers the GPU (256 blocks on an H200's 132 SMs), and splitting rows only adds the
# second launch. An expectation, not yet timed (benchmarks/kernels_bench.py --only argmax).
TORCH_FROM_ROWS = 256


@triton.jit
def _max_first_index(vals, idx, valid):
    """(max, first index of it) over a block; NaN beats every number. Every block has a valid entry."""
    big: tl.constexpr = 2147483647
    is_nan = (vals != vals) & valid
    first_nan = tl.min(tl.where(is_nan, idx, big), axis=0)
    numbers = valid & (vals == vals)
    best = tl.max(tl.where(numbers, vals, float("-inf")), axis=0)
    first_best = tl.min(tl.where(numbers & (vals == best), idx, big), axis=0)
    has_nan = first_nan < big
    return tl.where(has_nan, float("nan"), best), tl.where(has_nan, first_nan, first_best)


@triton.jit
def _chunk_argmax_kernel(
    x_ptr, part_val_ptr, part_idx_ptr, stride_x, n_cols, n_chunks, CHUNK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    after_producer(PDL)  # pdl.py
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = cols < n_cols
    vals = tl.load(x_ptr + row * stride_x + cols, mask=valid, other=float("-inf")).to(tl.float32)
    best, first = _max_first_index(vals, cols, valid)
    tl.store(part_val_ptr + row * n_chunks + chunk, best)
    tl.store(part_idx_ptr + row * n_chunks + chunk, first)


@triton.jit
def _merge_partials_kernel(part_val_ptr, part_idx_ptr, out_ptr, n_chunks, BLOCK: tl.constexpr, PDL: tl.constexpr):
    after_producer(PDL)  # pdl.py
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, BLOCK)
    valid = chunks < n_chunks
    vals = tl.load(part_val_ptr + row * n_chunks + chunks, mask=valid, other=float("-inf"))
    idx = tl.load(part_idx_ptr + row * n_chunks + chunks, mask=valid, other=0)
    # partials are in chunk order, so the smallest index among the tied partials is the row's first
    _, first = _max_first_index(vals, idx, valid)
    tl.store(out_ptr + row, first.to(tl.int64))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, V] (fp32, bf16 or fp16) -> int64 [rows], as logits.argmax(dim=-1)."""
    if logits.dim() != 2 or logits.shape[0] == 0 or logits.shape[1] == 0 or logits.shape[0] >= TORCH_FROM_ROWS:
        return logits.argmax(dim=-1)  # torch's own errors for V == 0 and other ranks
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, n_cols = logits.shape
    n_chunks = triton.cdiv(n_cols, CHUNK)
    part_val = torch.empty(rows, n_chunks, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(rows, n_chunks, dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _chunk_argmax_kernel[(rows, n_chunks)](
        logits, part_val, part_idx, logits.stride(0), n_cols, n_chunks, CHUNK=CHUNK, num_warps=4, **pdl.launch(logits)
    )
    block = max(16, triton.next_power_of_2(n_chunks))
    _merge_partials_kernel[(rows,)](part_val, part_idx, out, n_chunks, BLOCK=block, num_warps=1, **pdl.launch(logits))
    return out
