"""`fused_moe`: the whole MoE block on Triton kernels (what `atomc_triton::moe` runs).

    router logits -> softmax top-k (moe_routing.py; else select_experts) -> local ids (expert_map)
    -> gate/up GEMM + activation -> down GEMM (+ bias) -> weighted sum over k (moe_combine)

Three routes: one token (batch-1 decode), CUDA-core GEMVs over its k experts (moe_gemv.py); few
(token, expert) pairs, the tensor-core kernels of moe_gemm.py without a sort, each chosen expert's
weights read once by the programs of its first pair; many pairs, the same kernels over pairs sorted
by expert and padded to the row block on the device (moe_align.py): grouped GEMMs.
The route and tiles come from moe_config.py (tuned JSON, else a default). No host sync and no
data-dependent shape anywhere, so the op captures in a CUDA graph.

The routing weights are applied in the combine, not the down GEMM's epilogue: the expert outputs
are then rounded to x's dtype before the fp32 weighted sum exactly as the reference rounds them,
and the combine is one deterministic pass (no atomics) over [T * k, H] rows in x's dtype. On the
one-token route the down GEMV does that combine itself (moe_gemv.py), in the same order; so can
the few-pair route's down kernel at one token (COMBINE_IN_DOWN_ONE_TOKEN, moe_gemm.py's
COMBINE_LAST).
"""

from __future__ import annotations

import torch
import triton

from atomc.kernels.triton import arrivals, moe_config, moe_gemv, pdl, tuned_files
from atomc.kernels.triton.moe_align import align_by_expert
from atomc.kernels.triton.moe_gemm import moe_combine_kernel, moe_down_kernel, moe_gate_up_kernel
from atomc.kernels.triton.moe_routing import route
from atomc.kernels.triton.moe_tiles import ACT_SILU, ACT_SWIGLU_OAI, DENSE
from atomc.ops.moe import check_shared_experts

ACTIVATION_CODES = {"silu": ACT_SILU, "swiglu_oai": ACT_SWIGLU_OAI}
COMBINE_BLOCK_H = 1024
# One token on the few-pair route: the down kernel's last program a tile sums the k expert rows
# (COMBINE_LAST), so no combine kernel is launched: one launch fewer a MoE layer at batch 1. On an
# H100, Qwen3-30B-A3B's down kernel went 11.05 -> 12.48 us and its 1.93 us combine went away
# (docs/performance.md section 20).
COMBINE_IN_DOWN_ONE_TOKEN = True


def down_combine_args(x: torch.Tensor, path: str, h: int, block_n: int, weights, local, out) -> dict:
    """moe_down_kernel's COMBINE_LAST arguments for this launch: on where the down kernel sums the
    experts itself, off where the combine kernel runs (tensors in every pointer either way, so the
    JIT never specialises on a None)."""
    counters = None
    if COMBINE_IN_DOWN_ONE_TOKEN and path == "small" and x.shape[0] == 1:
        counters = arrivals.counters(x.device, "moe_down_combine")
    on = counters is not None and triton.cdiv(h, block_n) <= counters.numel()
    return dict(weights_ptr=weights, out_ptr=out, counter_ptr=counters if on else local, COMBINE_LAST=on)


def fused_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    config: dict | None = None,
    num_shared: int = 0,
) -> torch.Tensor:
    """`experts_reference` on the kernels: x [T, H], weights fp32 [T, k], ids int32 [T, k] (global)
    -> [T, H]. `config` overrides the tuned/default configuration (the tuner and tests use it).
    `num_shared`: how many of the k slots (the last) and of the experts are shared ones
    (atomc/ops/moe.py); the tuned tiles are looked up under the routed counts, the model's."""
    t, h = x.shape
    e_local, two_i, h_w = w13.shape
    inter = two_i // 2
    k = ids.shape[1]
    if h_w != h or w2.shape != (e_local, h, inter):
        raise ValueError(f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} do not fit")
    if activation not in ACTIVATION_CODES:
        raise ValueError(f"fused_moe: activation {activation!r} (supported: {', '.join(ACTIVATION_CODES)})")
    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    p = t * k
    local = ids.reshape(p).to(torch.int32)
    if expert_map is not None:
        local = expert_map.to(torch.int32)[local.long()]
    if config is None:
        dev = tuned_files.tile_device(x.device)
        config = moe_config.pick_config(t, e_local - num_shared, h, inter, k - num_shared, x.dtype, dev.name,
                                        family=dev.family, num_shared=num_shared)  # fmt: skip
    out = torch.empty_like(x)
    if t == 0:
        return out
    combined_in_down = moe_gemv.combines_in_down(config)
    act = x.new_empty(p, inter)
    y = None if combined_in_down else x.new_empty(p, h)  # the expert outputs, when a combine kernel sums them
    code = ACTIVATION_CODES[activation]
    weights = weights.float().contiguous()
    if config["path"] == "gemv":
        if t != 1:
            raise ValueError(f"fused_moe: the gemv route takes one token, got {t}")
        moe_gemv.launch(x, w13, w2, w13_bias, w2_bias, local, weights, act, y, out, code, alpha, limit, config)
        if combined_in_down:
            return out
    elif _grouped(x, w13, w2, w13_bias, w2_bias, local, act, y, code, alpha, limit, config, weights, out):
        return out
    block_h = min(COMBINE_BLOCK_H, triton.next_power_of_2(h))
    moe_combine_kernel[(t, triton.cdiv(h, block_h))](
        y, weights, local, out, h, y.stride(0), out.stride(0), TOPK=k, BLOCK_H=block_h, **pdl.launch(x),
    )  # fmt: skip
    return out


def _grouped(x, w13, w2, w13_bias, w2_bias, local, act, y, code, alpha, limit, config, weights, out) -> bool:
    """The tensor-core GEMMs (moe_gemm.py), routed by the few-pair scan or by expert-sorted blocks.
    True where the down kernel also wrote `out` (COMBINE_IN_DOWN_ONE_TOKEN)."""
    p, (e_local, h, inter) = local.numel(), w2.shape
    k = p // x.shape[0]
    sorted_route = config["path"] == "sorted"
    if sorted_route:
        block_m = config["gate_up"]["block_m"]
        sorted_ids, block_expert, num_padded = align_by_expert(local, e_local, block_m)
        row_groups = block_expert.numel()
    else:
        if p > moe_config.SMALL_PATH_MAX_PAIRS:
            raise ValueError(f"fused_moe: the small path takes <= {moe_config.SMALL_PATH_MAX_PAIRS} pairs, got {p}")
        block_m = max(16, triton.next_power_of_2(x.shape[0]))  # one row per token
        sorted_ids = block_expert = num_padded = local  # unused by the small route
        row_groups = p
    ieee = x.dtype == torch.float32
    slots = triton.next_power_of_2(k)
    route = (local, sorted_ids, block_expert, num_padded)
    gu, dn = config["gate_up"], config["down"]
    if sorted_route and dn.get("block_m", block_m) != block_m:
        raise ValueError("fused_moe: both GEMMs of the sorted path share one block_m (one alignment)")
    moe_gate_up_kernel[(row_groups, triton.cdiv(inter, gu["block_n"]))](
        x, w13, w13, w13_bias if w13_bias is not None else w13, act, *route,
        p, h, inter,
        x.stride(0), w13.stride(0), w13.stride(1), 0, 0, 0, 0 if w13_bias is None else w13_bias.stride(0),
        act.stride(0), float(alpha), float(limit),
        TOPK=k, ACT=code, HAS_BIAS=w13_bias is not None, ROUTE_SORTED=sorted_route,
        IEEE=ieee, WEIGHTS=DENSE, BLOCK_M=block_m, BLOCK_N=gu["block_n"], BLOCK_K=gu["block_k"], BLOCK_SLOTS=slots,
        num_warps=gu["num_warps"], num_stages=gu["num_stages"], **pdl.launch(x),
    )  # fmt: skip
    combine = down_combine_args(x, config["path"], h, dn["block_n"], weights, local, out)
    moe_down_kernel[(row_groups, triton.cdiv(h, dn["block_n"]))](
        act, w2, w2, w2_bias if w2_bias is not None else w2, y, *route,
        p, h, inter,
        act.stride(0), w2.stride(0), w2.stride(1), 0, 0, 0, 0 if w2_bias is None else w2_bias.stride(0), y.stride(0),
        TOPK=k, HAS_BIAS=w2_bias is not None, ROUTE_SORTED=sorted_route, IEEE=ieee, WEIGHTS=DENSE,
        BLOCK_M=block_m, BLOCK_N=dn["block_n"], BLOCK_K=dn["block_k"], BLOCK_SLOTS=slots,
        num_warps=dn["num_warps"], num_stages=dn["num_stages"], **pdl.launch(x), **combine,
    )  # fmt: skip
    return combine["COMBINE_LAST"]


def fused_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    expert_map: torch.Tensor | None,
    correction_bias: torch.Tensor | None,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = True,
    num_expert_group: int = 0,
    topk_group: int = 0,
    routed_scaling_factor: float = 1.0,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    num_shared_experts: int = 0,
) -> torch.Tensor:
    """`atomc::moe` (same arguments): the routing in one Triton kernel (moe_routing.py; else
    `select_experts` in torch), the experts on the Triton kernels."""
    check_shared_experts(num_shared_experts, expert_map)
    weights, ids = route(
        router_logits, top_k, scoring, renormalize, correction_bias, num_expert_group, topk_group,
        routed_scaling_factor, num_shared_experts,
    )  # fmt: skip
    return fused_experts(x, weights, ids, w13, w2, w13_bias, w2_bias, expert_map, activation, swiglu_alpha,
                         swiglu_limit, num_shared=num_shared_experts)  # fmt: skip
