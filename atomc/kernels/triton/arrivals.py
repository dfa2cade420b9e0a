"""Arrival counters: the last program of a group to finish does the group's closing work (a
split-KV merge, a MoE combine) inside the same kernel, instead of a second kernel launch.

A program stores its part, then `arrive`s: a barrier puts every thread's stores before an
acq_rel atomic increment, so the program that draws the last ticket sees all the parts (read them
with ".cg", from L2 past this SM's L1), does the closing work and zeroes the counter for the next
launch. Which program arrives last varies from run to run; what it computes does not (it reads
the parts in a fixed order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Per (device, user): int32 counters, zero between launches (the last arrival resets its own). Made
# by the first call outside a CUDA-graph capture and never freed, since captured graphs keep their
# address; launches on one stream run one after another, so one buffer serves a user's every
# launch. A launch that finds none (the first call under a capture) or too few counters takes its
# kernel-launch path instead.
_COUNTERS: dict[tuple[torch.device, str], torch.Tensor] = {}
NUM_COUNTERS = 1 << 12


def counters(device: torch.device, user: str) -> torch.Tensor | None:
    key = (device, user)
    found = _COUNTERS.get(key)
    if found is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        found = _COUNTERS[key] = torch.zeros(NUM_COUNTERS, dtype=torch.int32, device=device)
    return found


@triton.jit
def arrive(counter):
    """This program's ticket (0, 1, ...) after its stores; the holder of the last one must `reset`."""
    tl.debug_barrier()
    return tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")


@triton.jit
def reset(counter):
    tl.store(counter, 0)
