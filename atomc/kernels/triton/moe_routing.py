"""Softmax top-k routing in one kernel: router logits [T, E] -> (weights fp32 [T, k], ids int32 [T, k]).

`select_experts` (atomc/ops/moe.py) takes five or six torch launches (softmax, topk, gather, sum,
divide); at batch-1 decode a Qwen3-MoE layer reads only ~75 MB of expert weights (about 18 µs on
an H200), so those launches would be a third of the layer. This kernel does the common case
(softmax scoring, no expert groups, no correction bias: Mixtral, Qwen3-MoE, GPT-OSS) in one
launch, one program per token; other routings stay on `select_experts`.

The results of `select_experts` up to ties: fp32 softmax over all experts, the k largest in
descending order, then optional renormalisation over the chosen k and scaling. Among equal scores
the lower expert id wins here (deterministic); torch.topk, which `select_experts` and transformers
call, leaves that order unspecified, so the two can pick different (equally weighted) experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atomc.kernels.triton import gemv, pdl
from atomc.kernels.triton.gemv import row_dot
from atomc.kernels.triton.pdl import after_producer
from atomc.ops.moe import select_experts

MAX_EXPERTS = 1024  # one program holds a token's whole logit row


@triton.jit
def _softmax_top_k(logits, ok, offs, TOPK: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                   BLOCK_K: tl.constexpr, scale):  # fmt: skip
    """(weights fp32 [BLOCK_K], ids int32 [BLOCK_K]) of one token's fp32 logits [BLOCK_E] (`ok` the real
    experts): softmax, the TOPK largest in descending order, optional renormalisation, scaling."""
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
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)
    return weights * scale, ids


@triton.jit
def _softmax_topk_kernel(
    logits_ptr, weights_ptr, ids_ptr, E, stride_lt, scale,
    TOPK: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    after_producer(PDL)  # pdl.py: the logits come from the step
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    logits = tl.load(logits_ptr + t.to(tl.int64) * stride_lt + offs, mask=ok, other=-float("inf")).to(tl.float32)
    weights, ids = _softmax_top_k(logits, ok, offs, TOPK, RENORMALIZE, BLOCK_E, BLOCK_K, scale)
    slots = tl.arange(0, BLOCK_K)
    out = t * TOPK + slots
    tl.store(weights_ptr + out, weights, mask=slots < TOPK)
    tl.store(ids_ptr + out, ids, mask=slots < TOPK)


@triton.jit
def _router_softmax_topk_kernel(
    x_ptr, w_ptr, b_ptr, logits_ptr, weights_ptr, ids_ptr, ticket_ptr, E, H, stride_we, scale,
    HAS_BIAS: tl.constexpr, TOPK: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One token: each program computes BLOCK_N router logits (the reduce GEMV's `row_dot`, rounded
    to the logits' dtype as the GEMV rounds them), then draws a ticket; the program that draws the
    last one reads every logit and routes the token, then resets the ticket for the next launch."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < E
    y = row_dot(x_ptr, w_ptr, offs_n, n_ok, H, stride_we, BLOCK_N, BLOCK_H, PDL)  # waits (pdl.py)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(logits_ptr + offs_n, y.to(logits_ptr.dtype.element_ty), mask=n_ok)
    tl.debug_barrier()  # all of this program's logits are stored before its ticket (acq_rel: released)
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) - 1:
        offs = tl.arange(0, BLOCK_E)
        ok = offs < E
        # volatile: other SMs wrote these; read them from L2, not from a stale L1 line
        logits = tl.load(logits_ptr + offs, mask=ok, other=-float("inf"), volatile=True).to(tl.float32)
        weights, ids = _softmax_top_k(logits, ok, offs, TOPK, RENORMALIZE, BLOCK_E, BLOCK_K, scale)
        slots = tl.arange(0, BLOCK_K)
        tl.store(weights_ptr + slots, weights, mask=slots < TOPK)
        tl.store(ids_ptr + slots, ids, mask=slots < TOPK)
        tl.store(ticket_ptr, 0)  # zero again for the next launch (a CUDA graph replays this one)


def handles(scoring: str, correction_bias, num_expert_group: int, experts: int) -> bool:
    """Whether `softmax_topk` covers this routing (else use select_experts)."""
    return scoring == "softmax" and correction_bias is None and num_expert_group == 0 and experts <= MAX_EXPERTS


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool = True, routed_scaling_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_experts(router_logits, top_k, "softmax", renormalize, None, 0, 0, routed_scaling_factor)`."""
    t, e = router_logits.shape
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=router_logits.device)
    if t:
        _softmax_topk_kernel[(t,)](
            router_logits, weights, ids, e, router_logits.stride(0), float(routed_scaling_factor),
            TOPK=top_k, RENORMALIZE=renormalize, BLOCK_E=max(16, triton.next_power_of_2(e)),
            BLOCK_K=triton.next_power_of_2(top_k),
            num_warps=1 if e <= 128 else 4, **pdl.launch(router_logits),
        )  # fmt: skip
    return weights, ids


def router_fuses(x: torch.Tensor, router_weight: torch.Tensor) -> bool:
    """Whether `router_softmax_topk` takes this router: one token, and the weight the reduce GEMV
    would take for it (gemv.linear), so the logits are the same bits as that GEMV's."""
    return (
        x.dim() == 2 and x.shape[0] == 1 and router_weight.dim() == 2 and router_weight.stride(-1) == 1
        and x.dtype == router_weight.dtype and router_weight.shape[0] <= MAX_EXPERTS
    )  # fmt: skip


_TICKETS: dict[torch.device, torch.Tensor] = {}


def _ticket(device: torch.device) -> torch.Tensor:
    """One int32 counter per device, zero between launches: the router kernel's programs draw from it
    and its last program zeroes it. One is enough: under PDL every kernel waits for the one before
    it to finish before its first atomic, so no two router launches ever overlap."""
    t = _TICKETS.get(device)
    if t is None:
        t = _TICKETS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return t


def router_softmax_topk(
    x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor | None, top_k: int,
    renormalize: bool = True, routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`softmax_topk(gemv.linear(x, router_weight, router_bias), ...)` for one token [1, H] in one
    launch (`router_fuses` must hold): the decode step's router GEMV and its top-k, a launch fewer a
    MoE layer. The logits are the GEMV's bits (same tiles, same sum order)."""
    e, h = router_weight.shape
    x = x.contiguous()
    logits = x.new_empty(1, e)
    weights = torch.empty(1, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(1, top_k, dtype=torch.int32, device=x.device)
    cfg = gemv.reduce_config(e, h)
    block_h = min(cfg["block_k"], max(16, triton.next_power_of_2(h)))
    _router_softmax_topk_kernel[(triton.cdiv(e, cfg["block_n"]),)](
        x, router_weight, router_bias if router_bias is not None else router_weight, logits, weights, ids,
        _ticket(x.device), e, h, router_weight.stride(0), float(routed_scaling_factor),
        HAS_BIAS=router_bias is not None, TOPK=top_k, RENORMALIZE=renormalize,
        BLOCK_E=max(16, triton.next_power_of_2(e)), BLOCK_K=triton.next_power_of_2(top_k),
        BLOCK_N=cfg["block_n"], BLOCK_H=block_h, num_warps=cfg["num_warps"], num_stages=4, **pdl.launch(x),
    )  # fmt: skip
    return weights, ids


def route(
    router_logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool, correction_bias,
    num_expert_group: int, topk_group: int, routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`select_experts`' (weights, ids), through `softmax_topk` where it `handles` the routing."""
    if handles(scoring, correction_bias, num_expert_group, router_logits.shape[-1]):
        return softmax_topk(router_logits, top_k, renormalize, routed_scaling_factor)
    return select_experts(
        router_logits, top_k, scoring, renormalize, correction_bias, num_expert_group, topk_group,
        routed_scaling_factor,
    )  # fmt: skip
