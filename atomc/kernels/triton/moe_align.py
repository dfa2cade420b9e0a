"""Pairs sorted by expert and padded to the GEMM's row block, on the device, for the many-token path.

Every size here follows from (pairs, experts, block) alone, never from the routing: the buffers
are sized for the worst case (each expert's run padded by up to block - 1 rows), so the step runs
without a host sync and a CUDA graph captures it. The blocks past the real padded total are
marked by `num_padded` (a device scalar) and the GEMM programs that get them exit at once.

Torch ops for now (a stable argsort and a few scans); pairs whose expert is on another rank
(local id -1) are sorted last and dropped.
"""

from __future__ import annotations

import torch


def max_padded_rows(pairs: int, experts: int, block_m: int) -> int:
    return -(-(pairs + experts * (block_m - 1)) // block_m) * block_m


def align_by_expert(local: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """local [P] int32 local expert ids (-1 = not here) -> (sorted_ids [R] int32: pair ids grouped by
    expert, each group padded to a multiple of block_m with P; block_expert [R // block_m] int32:
    the expert of each block (`experts` past the end); num_padded [1] int32: rows in use)."""
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
