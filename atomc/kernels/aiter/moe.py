"""`torch.ops.atomc_aiter::moe`: the `atomc::moe` block on AITER (ROCm). UNTESTED ON AMD HARDWARE:
checked only against the stand-in `aiter` of tests/kernels/fake_aiter.py, on CPU. The op takes
atomc::moe's own schema (atomc/kernels/binding.py): its body takes `*args` and reads them by name.

    routing: softmax, no groups, no correction bias -> `topk_softmax`
             sigmoid + correction bias + groups, renormalised (DeepSeek-V3) -> `biased_grouped_topk`
             groups without a correction bias (DeepSeek-V2 softmax, or sigmoid) -> `grouped_topk`
             anything else -> atomc's `select_experts` (torch, on the device)
    experts: `aiter.fused_moe.fused_moe`, `ActivationType.Silu`, `QuantType.No`

The routed scaling factor is applied here after the routing call (AITER is passed 1.0), so the
order "renormalise, then scale" is atomc's whatever the kernel does with its own factor.

Expert parallelism: fused_moe's `expert_mask` is a 0/1 int32 vector over the ids it is given, and
an id's weight row is the number of ones before it (AITER's own torch reference: local id =
cumsum(mask) - 1). atomc's `expert_map` is any global -> local table, so the ids are first mapped
to local rows, off-rank choices to one extra id E_local, and the mask is E_local ones then a zero:
exact for any table, with no host sync and no data-dependent shape.

What AITER's unquantised fused_moe does not cover runs on ROCm's next backend (Triton, else the
reference), decided per call from the op's arguments (static in a traced graph): GPT-OSS's clamped
SwiGLU (AITER wires its `Swiglu` activation, with expert biases, for MXFP4 weights; bf16 experts
here), expert biases, and dtypes other than fp16/bf16 (fused_moe asserts them).
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from atomc.kernels.aiter.fallback import NextBackend
from atomc.kernels.binding import bind_as_atomc, named_args
from atomc.ops.moe import append_shared_experts, check_shared_experts, select_experts

FUSED_MOE_DTYPES = (torch.float16, torch.bfloat16)


def _aiter():
    import aiter

    return aiter


def _fused_moe():
    return importlib.import_module("aiter.fused_moe").fused_moe  # a submodule `import aiter` may not load


def aiter_declines(x: torch.Tensor, w13: torch.Tensor, w13_bias, w2_bias, activation: str) -> str | None:
    """Why AITER's fused_moe cannot run this call exactly (None when it can)."""
    if activation != "silu":
        return f"activation {activation!r}: AITER's Swiglu is wired for MXFP4 experts"
    if w13_bias is not None or w2_bias is not None:
        return "expert biases"
    if x.dtype not in FUSED_MOE_DTYPES or w13.dtype != x.dtype:
        return f"dtype {x.dtype} (weights {w13.dtype}): fused_moe takes fp16/bf16"
    return None


def route(
    router_logits: torch.Tensor,
    top_k: int,
    scoring: str,
    renormalize: bool,
    correction_bias: torch.Tensor | None,
    num_expert_group: int,
    topk_group: int,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], global ids int32 [T, k]), by AITER's routing kernel for the family."""
    logits = router_logits.contiguous()
    t = logits.shape[0]
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    aiter = _aiter()
    if num_expert_group == 0 and correction_bias is None and scoring == "softmax":
        aiter.topk_softmax(
            topk_weights=weights,
            topk_indices=ids,
            token_expert_indices=torch.empty_like(ids),
            gating_output=logits,
            need_renorm=renormalize,
        )
    elif num_expert_group > 0 and correction_bias is not None and scoring == "sigmoid" and renormalize:
        # renormalised only: for many tokens it dispatches to moe_fused_gate, which asserts need_renorm
        aiter.biased_grouped_topk(
            gating_output=logits,
            correction_bias=correction_bias.to(logits.dtype),
            topk_weights=weights,
            topk_ids=ids,
            num_expert_group=num_expert_group,
            topk_group=topk_group,
            need_renorm=True,
            routed_scaling_factor=1.0,
        )
    elif num_expert_group > 0 and correction_bias is None:
        aiter.grouped_topk(
            gating_output=logits,
            topk_weights=weights,
            topk_ids=ids,
            num_expert_group=num_expert_group,
            topk_group=topk_group,
            need_renorm=renormalize,
            is_softmax=scoring == "softmax",
            routed_scaling_factor=1.0,
        )
    else:  # no AITER kernel for it (e.g. sigmoid without groups)
        return select_experts(
            router_logits, top_k, scoring, renormalize, correction_bias, num_expert_group, topk_group,
            routed_scaling_factor,
        )  # fmt: skip
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids


def route_block(a) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` for an atomc::moe / moe_quant call's named arguments (binding.named_args), the
    shared-expert slots after the routed ones (appended in torch: AITER's routing kernels that take
    shared experts, topk_softmax's `num_shared_experts` and moe_fused_gate's, do not cover every
    routing here, and no AMD run has checked what weight they give those slots)."""
    check_shared_experts(a.num_shared_experts, a.expert_map)
    weights, ids = route(
        a.router_logits, a.top_k, a.scoring, a.renormalize, a.correction_bias, a.num_expert_group, a.topk_group,
        a.routed_scaling_factor,
    )  # fmt: skip
    return append_shared_experts(weights, ids, a.num_shared_experts, a.router_logits.shape[-1])


def local_ids_and_mask(ids: torch.Tensor, expert_map: torch.Tensor, num_local: int):
    """(ids in fused_moe's id space, expert_mask): local rows 0..E_local-1, off-rank choices E_local."""
    local = expert_map[ids.long()]
    ids = torch.where(local >= 0, local, num_local).to(torch.int32)
    # E_local ones then one zero, built without a host copy (CUDA-graph capture refuses one)
    mask = F.pad(torch.ones(num_local, dtype=torch.int32, device=ids.device), (0, 1))
    return ids, mask


def experts(x, weights, ids, w13, w2, expert_map) -> torch.Tensor:
    aiter = _aiter()
    mask = None
    if expert_map is not None:
        ids, mask = local_ids_and_mask(ids, expert_map, w13.shape[0])
    return _fused_moe()(
        hidden_states=x.contiguous(),
        w1=w13,
        w2=w2,
        topk_weight=weights,
        topk_ids=ids,
        expert_mask=mask,
        activation=aiter.ActivationType.Silu,
        quant_type=aiter.QuantType.No,
        doweight_stage1=False,
    )


# ROCm's next backend for what AITER declines (fallback.py)
next_backend = NextBackend("atomc_aiter::moe")
set_next_backend = next_backend.set


@bind_as_atomc("atomc_aiter", "moe")
def moe(*args) -> torch.Tensor:
    a = named_args("moe", args)  # atomc::moe's arguments, its defaults filled in
    if aiter_declines(a.x, a.w13, a.w13_bias, a.w2_bias, a.activation) is not None:
        return next_backend(*args)
    if a.x.shape[0] == 0:
        return torch.empty_like(a.x)
    weights, ids = route_block(a)
    return experts(a.x, weights, ids, a.w13, a.w2, a.expert_map)
