"""Softmax top-k routing in one kernel: router logits [T, E] -> (weights fp32 [T, k], ids int32 [T, k]).

`select_experts` (atomc/ops/moe.py) takes five or six torch launches (softmax, topk, gather, sum,
divide); at batch-1 decode a Qwen3-MoE layer reads only ~75 MB of expert weights (about 18 µs on
an H200), so those launches would be a third of the layer. This kernel does the common case
(softmax scoring, no expert groups, no correction bias: Mixtral, Qwen3-MoE, GPT-OSS) in one
launch, one program per token. DeepSeek's routings (sigmoid scores, a correction bias, expert
groups) have their own kernel, `grouped_topk` (one program per token: the logits as [groups,
experts a group]), on by default (GROUPED_KERNEL; timed on an H100); off, they take `select_experts`.

The results of `select_experts` up to ties: fp32 softmax over all experts, the k largest in
descending order, then optional renormalisation over the chosen k and scaling. Among equal scores
the lower expert id wins here (deterministic); torch.topk, which `select_experts` and transformers
call, leaves that order unspecified, so the two can pick different (equally weighted) experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomc.kernels.triton import pdl
from atomc.kernels.triton.pdl import after_producer
from atomc.ops.moe import append_shared_experts, select_experts

MAX_EXPERTS = 1024  # one program holds a token's whole logit row


@triton.jit
def _store_choice(
    weights_ptr, ids_ptr, t, weights, ids, slots, scale, E,
    TOPK: tl.constexpr, RENORMALIZE: tl.constexpr, SHARED: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Token t's k (weight, id) pairs, the weights renormalised over the k if asked, then scaled;
    then SHARED shared-expert slots (ids E.., weight 1.0: atomc/ops/moe.py's append_shared_experts)."""
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)
    weights = weights * scale
    row = t * (TOPK + SHARED)
    tl.store(weights_ptr + row + slots, weights, mask=slots < TOPK)
    tl.store(ids_ptr + row + slots, ids, mask=slots < TOPK)
    if SHARED > 0:
        s = tl.arange(0, BLOCK_S)
        ok = s < SHARED
        tl.store(weights_ptr + row + TOPK + s, tl.full(s.shape, 1.0, tl.float32), mask=ok)
        tl.store(ids_ptr + row + TOPK + s, (E + s).to(tl.int32), mask=ok)


@triton.jit
def _softmax_topk_kernel(
    logits_ptr, weights_ptr, ids_ptr, E, stride_lt, scale,
    TOPK: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr, SHARED: tl.constexpr = 0, BLOCK_S: tl.constexpr = 1,
):  # fmt: skip
    after_producer(PDL)  # pdl.py: the logits come from the step
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    logits = tl.load(logits_ptr + t.to(tl.int64) * stride_lt + offs, mask=ok, other=-float("inf")).to(tl.float32)
    num = tl.exp(logits - tl.max(logits, 0))
    left = tl.where(ok, num / tl.sum(num, 0), -1.0)  # padding lanes lose to every expert (probs >= 0)
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for s in tl.static_range(TOPK):
        best = tl.max(left, 0)
        idx = tl.min(tl.where(left == best, offs, BLOCK_E), 0)  # ties: the lower expert id
        weights = tl.where(slots == s, best, weights)
        ids = tl.where(slots == s, idx, ids)
        left = tl.where(offs == idx, -2.0, left)
    _store_choice(weights_ptr, ids_ptr, t, weights, ids, slots, scale, E, TOPK, RENORMALIZE, SHARED, BLOCK_S)


@triton.jit
def _grouped_topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, E, PER_GROUP, stride_lt, scale,
    TOPK: tl.constexpr, TOPK_GROUP: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr, SHARED: tl.constexpr = 0, BLOCK_S: tl.constexpr = 1,
):  # fmt: skip
    """DeepSeek's routing for one token: the logits as [groups, experts a group]; scores (sigmoid or
    softmax) plus the correction bias choose; a group's score is its best choice score, or the sum
    of its best two with a bias (sigmoid, V3); the TOPK_GROUP best groups are kept; the k best
    experts among them are taken in order (ties: the lower group, then the lower expert id), with
    their scores (no bias) as weights."""
    after_producer(PDL)  # pdl.py: the logits come from the step
    t = tl.program_id(0)
    g = tl.arange(0, BLOCK_G)[:, None]
    j = tl.arange(0, BLOCK_P)[None, :]
    expert = g * PER_GROUP + j
    ok = (j < PER_GROUP) & (expert < E)
    logits = tl.load(logits_ptr + t.to(tl.int64) * stride_lt + expert, mask=ok, other=-float("inf")).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    else:
        num = tl.exp(logits - tl.max(tl.max(logits, 1), 0))
        scores = num / tl.sum(tl.sum(num, 1), 0)
    choose = scores
    if HAS_BIAS:
        choose += tl.load(bias_ptr + expert, mask=ok, other=0.0).to(tl.float32)
    choose = tl.where(ok, choose, -float("inf"))
    best = tl.max(choose, 1)  # [BLOCK_G]
    if HAS_BIAS:  # the sum of the group's best two (the first best taken out by its lowest index)
        first = tl.min(tl.where(choose == best[:, None], j, BLOCK_P), 1)
        best += tl.max(tl.where(j == first[:, None], -float("inf"), choose), 1)
    groups = tl.arange(0, BLOCK_G)
    keep = tl.zeros((BLOCK_G,), dtype=tl.int1)
    for _ in tl.static_range(TOPK_GROUP):
        top = tl.max(tl.where(keep, -float("inf"), best), 0)
        pick = tl.min(tl.where((best == top) & ~keep, groups, BLOCK_G), 0)
        keep = keep | (groups == pick)
    left = tl.where(keep[:, None] & ok, choose, -float("inf"))
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    taken = expert < 0  # all false
    for s in tl.static_range(TOPK):
        top = tl.max(tl.max(tl.where(taken, -float("inf"), left), 1), 0)
        idx = tl.min(tl.min(tl.where((left == top) & ~taken, expert, E + BLOCK_G * BLOCK_P), 1), 0)
        hit = expert == idx
        weights = tl.where(slots == s, tl.sum(tl.sum(tl.where(hit, scores, 0.0), 1), 0), weights)
        ids = tl.where(slots == s, idx, ids)
        taken = taken | hit
    _store_choice(weights_ptr, ids_ptr, t, weights, ids, slots, scale, E, TOPK, RENORMALIZE, SHARED, BLOCK_S)


def handles(scoring: str, correction_bias, num_expert_group: int, experts: int) -> bool:
    """Whether `softmax_topk` covers this routing (else use select_experts)."""
    return scoring == "softmax" and correction_bias is None and num_expert_group == 0 and experts <= MAX_EXPERTS


def _outputs(router_logits: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = router_logits.shape[0]
    weights = torch.empty(t, slots, dtype=torch.float32, device=router_logits.device)
    return weights, torch.empty(t, slots, dtype=torch.int32, device=router_logits.device)


def _shared(num_shared: int) -> dict:
    return dict(SHARED=num_shared, BLOCK_S=triton.next_power_of_2(max(1, num_shared)))


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool = True, routed_scaling_factor: float = 1.0,
    num_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`select_experts(router_logits, top_k, "softmax", renormalize, None, 0, 0, routed_scaling_factor)`,
    then `num_shared` shared-expert slots (append_shared_experts)."""
    t, e = router_logits.shape
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    weights, ids = _outputs(router_logits, top_k + num_shared)
    if t:
        _softmax_topk_kernel[(t,)](
            router_logits, weights, ids, e, router_logits.stride(0), float(routed_scaling_factor),
            TOPK=top_k, RENORMALIZE=renormalize, BLOCK_E=max(16, triton.next_power_of_2(e)),
            BLOCK_K=triton.next_power_of_2(top_k),
            num_warps=1 if e <= 128 else 4, **_shared(num_shared), **pdl.launch(router_logits),
        )  # fmt: skip
    return weights, ids


# DeepSeek's routings (sigmoid or softmax scores, expert groups, a correction bias) in one launch
# instead of select_experts' dozen torch launches: DeepSeek-V3 at full width, one dense + one MoE
# layer in block FP8, decode graph 1.348 -> 1.309 ms at CONC 1, 4.576 -> 4.529 at CONC 64 (H100,
# docs/performance.md section 24); equal to select_experts up to ties (broken to the lower id).
GROUPED_KERNEL = True


def takes_grouped(experts: int, num_expert_group: int, topk_group: int) -> bool:
    """Whether `grouped_topk` takes this routing (whole groups, a kept count it can keep)."""
    groups = max(1, num_expert_group)
    keep = topk_group if num_expert_group > 0 else 1
    return experts <= MAX_EXPERTS and experts % groups == 0 and 1 <= keep <= groups


def grouped_topk(
    router_logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool, correction_bias,
    num_expert_group: int, topk_group: int, routed_scaling_factor: float, num_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`select_experts` with expert groups and/or a correction bias (DeepSeek-V2/V3), one launch;
    no groups is one group of every expert, all kept. Then `num_shared` shared-expert slots."""
    t, e = router_logits.shape
    groups = max(1, num_expert_group)
    keep = topk_group if num_expert_group > 0 else 1
    if not takes_grouped(e, num_expert_group, topk_group):
        raise ValueError(f"grouped_topk: {e} experts in {groups} groups keeping {keep} is not a routing it takes")
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    weights, ids = _outputs(router_logits, top_k + num_shared)
    bias = correction_bias if correction_bias is not None else router_logits
    if t:
        _grouped_topk_kernel[(t,)](
            router_logits, bias, weights, ids, e, e // groups, router_logits.stride(0), float(routed_scaling_factor),
            TOPK=top_k, TOPK_GROUP=keep, SIGMOID=scoring == "sigmoid", HAS_BIAS=correction_bias is not None,
            RENORMALIZE=renormalize, BLOCK_G=triton.next_power_of_2(groups),
            BLOCK_P=max(2, triton.next_power_of_2(e // groups)), BLOCK_K=triton.next_power_of_2(top_k),
            num_warps=1 if e <= 128 else 4, **_shared(num_shared), **pdl.launch(router_logits),
        )  # fmt: skip
    return weights, ids


def route(
    router_logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool, correction_bias,
    num_expert_group: int, topk_group: int, routed_scaling_factor: float, num_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`select_experts`' (weights, ids) with `num_shared` shared-expert slots after them, through
    `softmax_topk` where it `handles` the routing, and `grouped_topk` for DeepSeek's when
    GROUPED_KERNEL is on (both write the shared slots themselves: no launch for them)."""
    e = router_logits.shape[-1]
    if handles(scoring, correction_bias, num_expert_group, e):
        return softmax_topk(router_logits, top_k, renormalize, routed_scaling_factor, num_shared)
    if GROUPED_KERNEL and takes_grouped(e, num_expert_group, topk_group):
        return grouped_topk(router_logits, top_k, scoring, renormalize, correction_bias, num_expert_group,
                            topk_group, routed_scaling_factor, num_shared)  # fmt: skip
    weights, ids = select_experts(
        router_logits, top_k, scoring, renormalize, correction_bias, num_expert_group, topk_group,
        routed_scaling_factor,
    )  # fmt: skip
    return append_shared_experts(weights, ids, num_shared, e)
