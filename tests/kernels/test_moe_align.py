"""The one-launch expert alignment (moe_align.py `align_by_expert_kernel`) against the torch ops it
replaces, through the Triton interpreter: the same sorted ids, block experts and padded total, to
the last entry (integers: nothing to round), for batches with experts on other ranks, experts with
no pair, one expert taking every pair, and sizes around the kernel's chunk and counting steps."""

import importlib

import pytest
import torch
from triton_interpreter import use_interpreter

use_interpreter()  # before the first triton import

triton = pytest.importorskip("triton")
from triton_kernel_cases import make_moe, rel_err  # noqa: E402

from atomc.kernels.triton import moe_align  # noqa: E402
from atomc.kernels.triton.moe import fused_experts  # noqa: E402
from atomc.ops.moe import experts_reference, select_experts  # noqa: E402


def ids(pairs: int, experts: int, seed: int, off_rank: float = 0.0, skew: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    local = torch.randint(0, max(1, experts // 4) if skew else experts, (pairs,), generator=g, dtype=torch.int32)
    if off_rank:
        local[torch.rand(pairs, generator=g) < off_rank] = -1
    return local


def assert_same(local: torch.Tensor, experts: int, block_m: int):
    want = moe_align.align_by_expert_torch(local, experts, block_m)
    got = moe_align.align_by_expert_kernel(local, experts, block_m)
    for name, a, b in zip(("sorted_ids", "block_expert", "num_padded"), got, want, strict=True):
        assert a.dtype == b.dtype == torch.int32 and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name} differs at {(a != b).nonzero().flatten()[:8].tolist()}"


@pytest.mark.parametrize("experts,block_m", [(6, 16), (8, 64), (64, 16), (128, 32), (128, 64), (256, 128)])
@pytest.mark.parametrize("pairs", [1, 7, 64, 129, 1000])
def test_kernel_matches_the_torch_ops(pairs, experts, block_m):
    assert_same(ids(pairs, experts, seed=pairs + experts), experts, block_m)


@pytest.mark.parametrize("gather", [True, False], ids=["gather", "one_hot"])
@pytest.mark.parametrize("experts,block_m", [(8, 64), (128, 16), (257, 64)])
@pytest.mark.parametrize("pairs", [7, 129, 1000, 3000])
def test_gathered_and_one_hot_places_match_the_torch_ops(pairs, experts, block_m, gather, monkeypatch):
    # GATHER_PICK (on): 128-pair chunks at every expert count; off, the one-hot pick keeps its
    # [chunk, bins] tile at 16K values (DeepSeek-V3's 257 experts: 32-pair chunks)
    monkeypatch.setattr(moe_align, "GATHER_PICK", gather)
    bins = triton.next_power_of_2(experts + 2)
    assert moe_align._chunk(bins) == (128 if gather else max(16, min(128, 16384 // bins)))
    assert moe_align._chunk(triton.next_power_of_2(257 + 2)) == (128 if gather else 32)
    assert_same(ids(pairs, experts, seed=pairs + experts, off_rank=0.05), experts, block_m)


@pytest.mark.parametrize("pairs", [300, 2049])
def test_experts_on_other_ranks_and_experts_without_pairs(pairs):
    # a quarter of the pairs belong to other ranks (dropped); the skew leaves most experts empty
    assert_same(ids(pairs, 32, seed=1, off_rank=0.25, skew=True), 32, 16)
    assert_same(ids(pairs, 32, seed=2, off_rank=1.0), 32, 16)  # nothing here: every row is padding


def test_one_expert_takes_every_pair():
    assert_same(torch.full((513,), 3, dtype=torch.int32), 8, 32)
    # a run of 132 blocks: its block experts take three RUN_STEP steps
    assert_same(torch.full((2100,), 5, dtype=torch.int32), 8, 16)


def test_the_largest_batch_it_takes():
    p = moe_align.ONE_KERNEL_MAX_PAIRS
    assert_same(ids(p, 128, seed=3, off_rank=0.1), 128, 64)


@pytest.fixture
def kernel_calls(monkeypatch) -> list[int]:
    """The switch on; the pair counts the one-launch alignment is called with."""
    monkeypatch.setattr(moe_align, "ALIGN_IN_ONE_KERNEL", True)
    calls = []
    real = moe_align.align_by_expert_kernel
    monkeypatch.setattr(moe_align, "align_by_expert_kernel", lambda *a: calls.append(a[0].numel()) or real(*a))
    return calls


def test_the_switch_routes_by_size(kernel_calls):
    moe_align.align_by_expert(ids(10, 8, seed=4), 8, 16)
    moe_align.align_by_expert(ids(moe_align.ONE_KERNEL_MAX_PAIRS + 1, 8, seed=5), 8, 16)  # the torch ops
    assert kernel_calls == [10]


def test_sorted_route_with_the_kernel(kernel_calls, monkeypatch):
    # the fused MoE's sorted route gives the same output with either alignment
    moe = importlib.import_module("atomc.kernels.triton.moe")
    tile = dict(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)
    config = {"path": "sorted", "gate_up": dict(tile), "down": dict(tile)}
    x, logits, w13, w2, _, _ = make_moe(37, 6, 48, 40, 2, torch.float32, "cpu", seed=7)
    args = (x, *select_experts(logits, 2), w13, w2, None, None, None, "silu", 1.702, 7.0)
    with monkeypatch.context() as off:  # the torch ops (the switch is on by default)
        off.setattr(moe_align, "ALIGN_IN_ONE_KERNEL", False)
        before = fused_experts(*args, config=config)
    assert kernel_calls == []
    after = fused_experts(*args, config=config)
    assert kernel_calls == [74] and moe.align_by_expert is moe_align.align_by_expert
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert rel_err(after, experts_reference(*args)) < 1e-5
