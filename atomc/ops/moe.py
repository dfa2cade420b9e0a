"""`atomc::moe`: a whole mixture-of-experts block, from router logits to the weighted sum of experts.

Models call this one op for the block, the way they call attention; a backend lowers it to a fused
kernel (Triton, AITER) and the body here is the reference every kernel is tested against.

    router_logits [T, E] -> select_experts (scoring, optional DeepSeek groups and correction bias,
    top-k, renormalisation, scaling) -> per chosen expert: act(x @ w13[e].T + b13[e]) @ w2[e].T + b2[e]
    -> sum over the k chosen experts, weighted

Weights are stacked per expert: `w13` [E_local, 2I, H] holds the gate rows then the up rows, `w2`
[E_local, H, I]. `expert_map` [E] (int32) maps a global expert id to its row in w13/w2, -1 where the
expert lives on another rank (expert parallelism): such a choice contributes nothing here and the
ranks' outputs are summed by the caller. Without it, global id = local row.

Shared experts (DeepSeek's `n_shared_experts`, which every token runs) may ride in the same op:
with `num_shared_experts` S > 0, w13 / w2 hold S more rows after the E routed experts (a shared MLP of
intermediate size S*I cut into S experts of I: an MLP is a sum over its intermediate units), and
every token's routing gets S more slots, ids E..E+S-1 with weight 1.0 (`append_shared_experts`):
the kernels then read the shared weights in the same launches as the routed ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SCORINGS = ("softmax", "sigmoid")
ACTIVATIONS = ("silu", "swiglu_oai")


@torch.library.custom_op("atomc::moe", mutates_args=())
def moe(
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
    """x [T, H] -> [T, H]. Reference: an explicit loop over the experts that received tokens."""
    weights, ids = select_experts(
        router_logits, top_k, scoring, renormalize, correction_bias, num_expert_group, topk_group,
        routed_scaling_factor,
    )  # fmt: skip
    check_shared_experts(num_shared_experts, expert_map)
    weights, ids = append_shared_experts(weights, ids, num_shared_experts, router_logits.shape[-1])
    return experts_reference(x, weights, ids, w13, w2, w13_bias, w2_bias, expert_map, activation,
                             swiglu_alpha, swiglu_limit)  # fmt: skip


@moe.register_fake
def _(x, router_logits, w13, w2, w13_bias, w2_bias, expert_map, correction_bias, top_k, *args, **kwargs):
    return torch.empty_like(x)


def check_moe_args(scoring: str, activation: str, top_k: int, num_experts: int) -> None:
    """The config errors a family can make, raised when the model is built (not at the first step)."""
    if scoring not in SCORINGS:
        raise ValueError(f"MoE scoring {scoring!r} is not supported (supported: {', '.join(SCORINGS)})")
    if activation not in ACTIVATIONS:
        raise ValueError(f"MoE activation {activation!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and the number of experts ({num_experts})")


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = True,
    correction_bias: torch.Tensor | None = None,
    num_expert_group: int = 0,
    topk_group: int = 0,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], global expert ids int32 [T, k]), in fp32 whatever the logits' dtype.

    softmax (Mixtral, Qwen3-MoE, GPT-OSS: softmax over the chosen logits = softmax then renormalise)
    or sigmoid (DeepSeek-V3) scores; `correction_bias` shifts the scores used to choose but not the
    weights (DeepSeek-V3's e_score_correction_bias); with `num_expert_group` > 0, experts are chosen
    only from the `topk_group` best groups (a group's score: its best score for softmax, the sum of
    its best two for sigmoid with a bias, as DeepSeek does). Among equal scores the experts are
    torch.topk's choice on these fp32 scores, which is what transformers' routers call: torch does
    not specify it (on CPU it is not the lowest ids), so a kernel matches it only up to such ties."""
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    choose = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_group > 0:
        choose = _mask_to_best_groups(choose, num_expert_group, topk_group, correction_bias is not None)
    ids = torch.topk(choose, top_k, dim=-1, sorted=True).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids.to(torch.int32)


def check_shared_experts(num_shared: int, expert_map: torch.Tensor | None) -> None:
    """Shared experts ride in the op only without an expert map: every rank would need them, and
    their ids (E..) are past the map's."""
    if num_shared and expert_map is not None:
        raise ValueError("atomc::moe: shared experts inside the op are not supported with an expert_map")


def append_shared_experts(
    weights: torch.Tensor, ids: torch.Tensor, num_shared: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing with S shared-expert slots after the k routed ones: ids E..E+S-1 (E routed
    experts), weight 1.0 (the routed scaling factor is the routed experts' alone, as DeepSeek adds
    its shared experts unscaled). Unchanged for S = 0."""
    if num_shared == 0:
        return weights, ids
    t = ids.shape[0]
    shared = torch.arange(num_experts, num_experts + num_shared, dtype=ids.dtype, device=ids.device)
    ones = torch.ones(t, num_shared, dtype=weights.dtype, device=weights.device)
    return torch.cat([weights, ones], dim=1), torch.cat([ids, shared.expand(t, num_shared)], dim=1)


def _mask_to_best_groups(choose: torch.Tensor, groups: int, keep: int, sum_top2: bool) -> torch.Tensor:
    t, e = choose.shape
    grouped = choose.view(t, groups, e // groups)
    group_score = grouped.topk(2, dim=-1).values.sum(-1) if sum_top2 else grouped.max(dim=-1).values
    best = group_score.topk(keep, dim=-1, sorted=False).indices
    mask = torch.zeros(t, groups, dtype=torch.bool, device=choose.device).scatter_(1, best, True)
    return choose.masked_fill(~mask.repeat_interleave(e // groups, dim=1), float("-inf"))


def apply_activation(h: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """h [N, 2I] (gate, then up) -> [N, I]."""
    gate, up = h.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    # GPT-OSS: gate clamped above, up clamped both ways, gate * sigmoid(alpha * gate) * (up + 1)
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)


def experts_reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    expert_map: torch.Tensor | None,
    activation: str,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """Sum over each token's chosen experts of weight * expert(x): GEMMs in x's dtype, the weighted
    sum accumulated in fp32 and cast back once."""
    local = ids.long() if expert_map is None else expert_map[ids.long()].long()
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(local[local >= 0]).tolist():
        token, slot = torch.nonzero(local == e, as_tuple=True)
        h = F.linear(x[token], w13[e], None if w13_bias is None else w13_bias[e])
        y = F.linear(apply_activation(h, activation, alpha, limit), w2[e], None if w2_bias is None else w2_bias[e])
        out.index_add_(0, token, y.float() * weights[token, slot, None])
    return out.to(x.dtype)
