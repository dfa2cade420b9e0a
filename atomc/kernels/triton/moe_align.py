"""Pairs sorted by expert and padded to the GEMM's row block, on the device, for the many-token path.

Every size here follows from (pairs, experts, block) alone, never from the routing: the buffers
are sized for the worst case (each expert's run padded by up to block - 1 rows), so the step runs
without a host sync and a CUDA graph captures it. The blocks past the real padded total are
marked by `num_padded` (a device scalar) and the GEMM programs that get them exit at once. Pairs
whose expert is on another rank (local id -1) are dropped. The order is stable: within an expert's
run, pairs keep their order.

Two ways, the same outputs to the last entry (tests/kernels/test_moe_align.py):
- `align_by_expert_torch`: torch ops (a stable argsort, scans, a scatter, a searchsorted): about
  25 launches, paid by every MoE layer of every step past the small route;
- `align_by_expert_kernel` (`ALIGN_IN_ONE_KERNEL`, up to ONE_KERNEL_MAX_PAIRS pairs): one launch.
  Program c places the pairs of chunk c (`_chunk` pairs): every program counts all pairs per expert
  (two histograms a COUNT pairs: at most ONE_KERNEL_MAX_PAIRS / COUNT steps), so it knows each expert's
  padded start, and the pairs of its expert in the chunks before its own; a pair's place in its
  chunk is the number of earlier pairs of the same expert there (a [CHUNK, CHUNK] comparison).
  Program p also writes the padding rows and the block experts of experts p * FILL_EXPERTS .., and
  its share of the rows and blocks past the padded total.
On: alone in CUDA graphs on an H100 it took 5-18 us against the torch ops' 53-152 us up to 8,192
pairs, and 27-67 us against 140-156 up to 16,384 (Qwen3-30B-A3B's, DeepSeek-V2-Lite's, V3's and
Mixtral's expert counts), its outputs equal on the GPU (benchmarks/moe_align.py; docs/performance.md
section 26). The cost grows with pairs x chunks, and with the expert count (V3's 257 experts: 32-pair
chunks), so past 16,384 pairs, not timed, the torch ops stay. One compile per expert count: the
counts and the row block are run-time values (a block's padding rows PAD_STEP a step, the block
experts of an expert's run RUN_STEP a step). With the row block still a compile-time constant, a
Qwen3-30B-A3B serving run at CONC 64 (H100) had its median step 12% shorter than with the torch ops
but stalled about 2 s compiling a 128-row variant mid-run; with the run-time block it served 1.12x
the torch ops' throughput, no stall (performance.md section 27).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomc.kernels.triton import pdl
from atomc.kernels.triton.pdl import after_producer

ALIGN_IN_ONE_KERNEL = True
ONE_KERNEL_MAX_PAIRS = 16384  # each program reads every pair; the largest size timed (past it: the torch ops)
COUNT = 1024  # pairs a counting step
FILL_EXPERTS = 16  # experts whose padding a program writes
TAIL = 1024  # rows a program's step past the padded total
RUN_STEP = 64  # block experts of an expert's run a step
PAD_STEP = 16  # padding rows of an expert's run a step (the row block is a run-time value)


def max_padded_rows(pairs: int, experts: int, block_m: int) -> int:
    return -(-(pairs + experts * (block_m - 1)) // block_m) * block_m


def align_by_expert(local: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """local [P] int32 local expert ids (-1 = not here) -> (sorted_ids [R] int32: pair ids grouped by
    expert, each group padded to a multiple of block_m with P; block_expert [R // block_m] int32:
    the expert of each block (`experts` past the end); num_padded [1] int32: rows in use)."""
    if ALIGN_IN_ONE_KERNEL and 0 < local.numel() <= ONE_KERNEL_MAX_PAIRS:
        return align_by_expert_kernel(local, experts, block_m)
    return align_by_expert_torch(local, experts, block_m)


def align_by_expert_torch(local: torch.Tensor, experts: int, block_m: int):
    p = local.numel()
    dev = local.device
    rows = max_padded_rows(p, experts, block_m)
    key = torch.where(local >= 0, local, experts).long()  # off-rank pairs: a bucket past the last
    counts = torch.zeros(experts + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[experts:].zero_()  # a slice, not an index: no host scalar copied in (CUDA-graph capture)
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    run_start = counts.cumsum(0) - counts
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    rank = torch.arange(p, device=dev) - run_start[sorted_key]
    dest = torch.where(sorted_key < experts, pad_start[sorted_key] + rank, rows)  # `rows`: a spill slot
    sorted_ids = torch.full((rows + 1,), p, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, rows, block_m, device=dev)
    block_expert = torch.searchsorted(pad_end[:experts], block_start, right=True).to(torch.int32)
    return sorted_ids[:rows], block_expert, pad_end[experts - 1 : experts].to(torch.int32)


@triton.jit
def _keys(local_ptr, offs, P, E: tl.constexpr):
    """Each pair's bucket: its expert, E off-rank, E + 1 past the last pair."""
    ids = tl.load(local_ptr + offs, mask=offs < P, other=-1)
    return tl.where(offs < P, tl.where(ids >= 0, ids, E), E + 1)


@triton.jit
def _pick(values, index, BINS: tl.constexpr):
    """values[index] for each entry of `index` (values [BINS], a register vector)."""
    bins = tl.arange(0, BINS)
    return tl.sum(tl.where(index[:, None] == bins[None, :], values[None, :], 0), 1)


# one compiled kernel per expert count: the pair and row counts and the row block are plain
# arguments, so neither a batch or prefill of a new size nor the block the tile file picks for it
# compiles anything while serving (a block of 128 rows first seen mid-run stalled a CONC-64 run on
# an H100 for about 2 s: docs/performance.md section 27)
@triton.jit(do_not_specialize=["P", "ROWS", "NUM_BLOCKS", "BLOCK_M"])
def _align_kernel(
    local_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, P, ROWS, NUM_BLOCKS, BLOCK_M,
    E: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr, COUNT: tl.constexpr,
    FILL_E: tl.constexpr, PAD_STEP: tl.constexpr, RUN_STEP: tl.constexpr, TAIL: tl.constexpr, PDL: tl.constexpr,
    GATHER: tl.constexpr = False,
):  # fmt: skip
    after_producer(PDL)  # pdl.py: the ids come from the step's routing
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    my_start = pid * CHUNK
    bins = tl.arange(0, BINS)
    offs = tl.arange(0, CHUNK)
    counts = tl.zeros([BINS], tl.int32)
    before = tl.zeros([BINS], tl.int32)  # pairs of each expert before this program's chunk
    for c0 in range(0, P, COUNT):
        idx = c0 + tl.arange(0, COUNT)
        key = _keys(local_ptr, idx, P, E)
        counts += tl.histogram(key, BINS)
        if not GATHER or c0 < my_start:  # (GATHER: a step wholly past this chunk adds nothing before it)
            before += tl.histogram(tl.where(idx < my_start, key, E + 1), BINS)  # later pairs: the spare bin
    expert = bins < E
    padded = tl.where(expert, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    pad_end = tl.cumsum(padded, 0)
    pad_start = pad_end - padded
    num_padded = tl.sum(padded, 0)

    if my_start < P:  # place this chunk's pairs
        key = _keys(local_ptr, my_start + offs, P, E)
        earlier = (key[:, None] == key[None, :]) & (offs[None, :] < offs[:, None])
        rank = tl.sum(earlier.to(tl.int32), 1)
        if GATHER:  # a gather through shared memory: the chunk need not shrink as the bins grow
            dest = tl.gather(pad_start + before, key, 0) + rank
        else:
            dest = _pick(pad_start + before, key, BINS) + rank
        tl.store(sorted_ptr + dest, my_start + offs, mask=key < E)

    # padding rows and block experts of experts pid * FILL_E ..
    e_ids = pid * FILL_E + tl.arange(0, FILL_E)
    e_ok = e_ids < E
    e_start = _pick(pad_start, e_ids, BINS)
    e_count = _pick(counts, e_ids, BINS)
    e_padded = _pick(padded, e_ids, BINS)
    for j0 in range(0, BLOCK_M - 1, PAD_STEP):  # an expert's run ends in at most BLOCK_M - 1 padding rows
        j = j0 + tl.arange(0, PAD_STEP)
        pad_row = e_start[:, None] + e_count[:, None] + j[None, :]
        pad_ok = e_ok[:, None] & (e_count[:, None] + j[None, :] < e_padded[:, None])
        tl.store(sorted_ptr + pad_row, tl.full([FILL_E, PAD_STEP], 0, tl.int32) + P, mask=pad_ok)
    e_blocks = tl.where(e_ok, e_padded // BLOCK_M, 0)
    for b0 in range(0, tl.max(e_blocks, 0), RUN_STEP):
        b = b0 + tl.arange(0, RUN_STEP)
        run_ok = b[None, :] < e_blocks[:, None]
        tl.store(block_expert_ptr + e_start[:, None] // BLOCK_M + b[None, :], e_ids[:, None] + b[None, :] * 0,
                 mask=run_ok)  # fmt: skip

    # past the padded total: rows hold P, blocks hold E
    t = tl.arange(0, TAIL)
    for r0 in range(num_padded + pid * TAIL, ROWS, nprog * TAIL):
        tl.store(sorted_ptr + r0 + t, tl.full([TAIL], 0, tl.int32) + P, mask=r0 + t < ROWS)
    for b0 in range(num_padded // BLOCK_M + pid * TAIL, NUM_BLOCKS, nprog * TAIL):
        tl.store(block_expert_ptr + b0 + t, tl.full([TAIL], E, tl.int32), mask=b0 + t < NUM_BLOCKS)
    if pid == 0:
        tl.store(num_padded_ptr, num_padded)


# Each pair's place read by `tl.gather` instead of the [chunk, bins] one-hot pick, so every expert
# count gets 128-pair chunks (fewer programs, each counting every pair: half the counting work at
# Qwen3-30B-A3B's 128 experts, a quarter at DeepSeek-V3's 257), and a program skips the "before"
# histogram of the counting steps past its chunk (about a quarter of the rest). On: on an H100
# (benchmarks/moe_align.py, both in one run at 8f5e024) it took 6.9 / 19.5 / 32.6 us against
# 9.1 / 21.9 / 42.8 at Qwen3's 128 / 8,192 / 16,384 pairs and 30.6 against 69.3 at V3's 9,216; at
# V3's 144 and 576 pairs 0.3-0.6 us slower (docs/performance.md section 28).
GATHER_PICK = True


def _chunk(bins: int) -> int:
    """Pairs a placing program: 128 with GATHER_PICK; else its [chunk, bins] pick of each pair's
    start stays at 16K values."""
    return 128 if GATHER_PICK else max(16, min(128, 16384 // bins))


def align_by_expert_kernel(local: torch.Tensor, experts: int, block_m: int):
    """align_by_expert in one launch (the module docstring); local int32, at most
    ONE_KERNEL_MAX_PAIRS pairs."""
    p = local.numel()
    assert local.dtype == torch.int32 and local.is_contiguous() and 0 < p <= ONE_KERNEL_MAX_PAIRS
    assert block_m & (block_m - 1) == 0, block_m
    rows = max_padded_rows(p, experts, block_m)
    bins = triton.next_power_of_2(experts + 2)
    chunk = _chunk(bins)
    dev = local.device
    sorted_ids = torch.empty(rows, dtype=torch.int32, device=dev)
    block_expert = torch.empty(rows // block_m, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    programs = max(triton.cdiv(p, chunk), triton.cdiv(experts, FILL_EXPERTS))
    _align_kernel[(programs,)](
        local, sorted_ids, block_expert, num_padded, p, rows, rows // block_m, block_m,
        E=experts, BINS=bins, CHUNK=chunk, COUNT=COUNT, FILL_E=FILL_EXPERTS, PAD_STEP=PAD_STEP,
        RUN_STEP=RUN_STEP, TAIL=TAIL, GATHER=GATHER_PICK, num_warps=4,
        **pdl.launch(local),
    )  # fmt: skip
    return sorted_ids, block_expert, num_padded
