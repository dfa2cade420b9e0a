"""atomc::moe's reference (atomc/ops/moe.py), the body every MoE kernel is tested against, checked
against independent per-token loops: routing (softmax and sigmoid, correction bias, expert groups,
ties as transformers breaks them), the experts' weighted sum, the expert_map of expert
parallelism, and GPT-OSS's SwiGLU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from atomc.ops.moe import select_experts

E, H, INTER = 8, 16, 12


def naive_route(logits, k, scoring="softmax", renormalize=True, bias=None, groups=0, keep=0, scale=1.0):
    """One token at a time in plain Python (for logits without ties)."""
    all_w, all_ids = [], []
    for row in logits.float():
        scores = row.softmax(-1) if scoring == "softmax" else row.sigmoid()
        choose = (scores + bias.float() if bias is not None else scores).tolist()
        allowed = set(range(E))
        if groups:
            size = E // groups
            members = [list(range(g * size, (g + 1) * size)) for g in range(groups)]
            if bias is not None:  # a group's score: the sum of its best two
                gscore = [sum(sorted((choose[i] for i in m), reverse=True)[:2]) for m in members]
            else:
                gscore = [max(choose[i] for i in m) for m in members]
            best = sorted(range(groups), key=lambda g: -gscore[g])[:keep]
            allowed = {i for g in best for i in members[g]}
        ids = sorted(allowed, key=lambda i: -choose[i])[:k]
        w = torch.stack([scores[i] for i in ids])
        if renormalize:
            w = w / w.sum()
        all_w.append(w * scale)
        all_ids.append(ids)
    return torch.stack(all_w), torch.tensor(all_ids, dtype=torch.int32)


def random_weights(seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * INTER, H, generator=g) * 0.3
    w2 = torch.randn(E, H, INTER, generator=g) * 0.3
    b13 = torch.randn(E, 2 * INTER, generator=g) * 0.1 if bias else None
    b2 = torch.randn(E, H, generator=g) * 0.1 if bias else None
    return w13, w2, b13, b2


def dense_loop(x, weights, ids, w13, w2, b13, b2, activation="silu", alpha=1.702, limit=7.0):
    """Each token alone, each of its chosen experts alone."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e] @ x[t] + (b13[e] if b13 is not None else 0)
            gate, up = h[:INTER], h[INTER:]
            if activation == "silu":
                a = F.silu(gate) * up
            else:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                a = gate * torch.sigmoid(alpha * gate) * (up + 1)
            y = w2[e] @ a + (b2[e] if b2 is not None else 0)
            out[t] += weights[t, j] * y
    return out


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_softmax_routing_matches_a_per_token_sort(k, renormalize):
    logits = torch.randn(13, E, generator=torch.Generator().manual_seed(k))
    w, ids = select_experts(logits, k, "softmax", renormalize)
    nw, nids = naive_route(logits, k, renormalize=renormalize)
    assert ids.dtype == torch.int32 and torch.equal(ids, nids)
    torch.testing.assert_close(w, nw)
    if renormalize:
        torch.testing.assert_close(w.sum(-1), torch.ones(13))


def test_sigmoid_with_correction_bias_and_groups_matches_a_per_token_loop():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(17, E, generator=g)
    bias = torch.randn(E, generator=g) * 0.5
    w, ids = select_experts(logits, 3, "sigmoid", True, bias, num_expert_group=4, topk_group=2,
                            routed_scaling_factor=2.5)  # fmt: skip
    nw, nids = naive_route(logits, 3, "sigmoid", True, bias, groups=4, keep=2, scale=2.5)
    assert torch.equal(ids, nids)
    torch.testing.assert_close(w, nw)
    # the bias picks experts but does not weigh them: weights are the plain sigmoid scores, scaled
    scores = logits.sigmoid().gather(1, ids.long())
    torch.testing.assert_close(w, scores / scores.sum(-1, keepdim=True) * 2.5)
    # the groups restrict the choice: without them, some token picks differently
    _, free = select_experts(logits, 3, "sigmoid", True, bias)
    assert not torch.equal(free, ids)


def test_softmax_groups_score_a_group_by_its_best_expert():
    logits = torch.randn(9, E, generator=torch.Generator().manual_seed(4))
    w, ids = select_experts(logits, 2, "softmax", False, None, num_expert_group=2, topk_group=1)
    nw, nids = naive_route(logits, 2, renormalize=False, groups=2, keep=1)
    assert torch.equal(ids, nids)
    torch.testing.assert_close(w, nw)
    assert all(len({int(i) // 4 for i in row}) == 1 for row in ids)  # both from the one kept group


TIED = torch.tensor(
    [
        [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # three-way tie for two places
        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # all equal
        [0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 2.0, 0.5],  # a tie at the top, far apart
        [0.3, 0.0, 0.0, 0.7, 0.0, 0.7, 0.0, 0.7],  # a tie for the second place
        [-1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 3.0, -1.0],  # one winner, a 7-way tie behind it
    ]
)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_ties_break_as_transformers_routing_breaks_them(family):
    """transformers' routers on hidden states that are the logits themselves (an identity router).

    Both call torch.topk on the same fp32 softmax scores, so they choose the same experts among
    equal scores; torch leaves that choice unspecified (on CPU it is not the lowest ids), so the
    reference must keep calling torch.topk that way, not sort by id."""
    import transformers
    from transformers.models.mixtral import modeling_mixtral
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    if family == "mixtral":
        cfg = transformers.MixtralConfig(hidden_size=E, num_local_experts=E, num_experts_per_tok=2)
        router, renormalize = modeling_mixtral.MixtralTopKRouter(cfg), True
    else:
        cfg = transformers.Qwen3MoeConfig(hidden_size=E, num_experts=E, num_experts_per_tok=2, norm_topk_prob=False)
        router, renormalize = modeling_qwen3_moe.Qwen3MoeTopKRouter(cfg), False
    with torch.no_grad():
        router.weight.copy_(torch.eye(E))
        logits, hf_w, hf_ids = router(TIED)
    assert torch.equal(logits, TIED)  # the crafted ties reach the top-k exactly
    w, ids = select_experts(TIED, 2, "softmax", renormalize)
    assert ids.tolist() == hf_ids.tolist()
    torch.testing.assert_close(w, hf_w.float())
    # the same rows inside a larger batch are routed the same way
    batch = torch.cat([torch.randn(6, E, generator=torch.Generator().manual_seed(7)), TIED])
    assert select_experts(batch, 2, "softmax", renormalize)[1][6:].tolist() == hf_ids.tolist()


@pytest.mark.parametrize("activation, bias", [("silu", False), ("silu", True), ("swiglu_oai", True)])
def test_moe_equals_a_dense_per_token_loop(activation, bias):
    g = torch.Generator().manual_seed(5)
    x, logits = torch.randn(7, H, generator=g), torch.randn(7, E, generator=g)
    w13, w2, b13, b2 = random_weights(bias=bias)
    if activation == "swiglu_oai":
        w13 = w13 * 8  # push some gate/up values past the clamp limit
    out = torch.ops.atomc.moe(x, logits, w13, w2, b13, b2, None, None, 2, "softmax", True, 0, 0, 1.0,
                              activation, 1.702, 7.0)  # fmt: skip
    weights, ids = naive_route(logits, 2)
    want = dense_loop(x, weights, ids, w13, w2, b13, b2, activation)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    if activation == "swiglu_oai":
        assert (torch.einsum("eih,th->tei", w13, x).abs() > 7.0).any()  # the clamp was exercised


def test_expert_map_halves_sum_to_the_whole_and_skip_foreign_experts():
    g = torch.Generator().manual_seed(6)
    x, logits = torch.randn(9, H, generator=g), torch.randn(9, E, generator=g)
    w13, w2, _, _ = random_weights()
    whole = torch.ops.atomc.moe(x, logits, w13, w2, None, None, None, None, 2)
    halves = []
    for r in (0, 1):
        emap = torch.full((E,), -1, dtype=torch.int32)
        emap[r * 4 : (r + 1) * 4] = torch.arange(4, dtype=torch.int32)
        halves.append(torch.ops.atomc.moe(x, logits, w13[r * 4 : (r + 1) * 4], w2[r * 4 : (r + 1) * 4],
                                          None, None, emap, None, 2))  # fmt: skip
    torch.testing.assert_close(halves[0] + halves[1], whole, atol=1e-5, rtol=1e-5)
    # a token none of whose experts is local gets exactly zero from this rank
    _, ids = select_experts(logits, 2)
    remote = (ids >= 4).all(-1)
    assert remote.any() and torch.equal(halves[0][remote], torch.zeros_like(halves[0][remote]))


@pytest.mark.parametrize("shared", [1, 2])
def test_shared_experts_in_the_op_equal_the_shared_mlp_beside_it(shared):
    """DeepSeek's shared MLP (intermediate shared * I) cut into `shared` experts after the routed
    ones (atomc/ops/moe.py) gives the routed block plus that MLP, unscaled by the routing factor."""
    g = torch.Generator().manual_seed(8)
    x, logits = torch.randn(6, H, generator=g), torch.randn(6, E, generator=g)
    w13, w2, _, _ = random_weights()
    gate, up = 0.3 * torch.randn(shared * INTER, H, generator=g), 0.3 * torch.randn(shared * INTER, H, generator=g)
    down = 0.3 * torch.randn(H, shared * INTER, generator=g)
    mlp = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    chunks13 = [torch.cat([gc, uc]) for gc, uc in zip(gate.split(INTER), up.split(INTER), strict=True)]
    fused13 = torch.cat([w13, torch.stack(chunks13)])
    fused2 = torch.cat([w2, torch.stack(down.split(INTER, dim=1))])
    args = (None, None, None, None, 2, "sigmoid", True, 4, 2, 2.5)
    got = torch.ops.atomc.moe(x, logits, fused13, fused2, *args, "silu", 1.702, 7.0, shared)
    want = torch.ops.atomc.moe(x, logits, w13, w2, *args) + mlp
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="expert_map"):  # shared experts are past the map's ids
        torch.ops.atomc.moe(x, logits, fused13, fused2, None, None, torch.arange(E, dtype=torch.int32), *args[3:],
                            "silu", 1.702, 7.0, shared)  # fmt: skip


def test_fake_gives_the_shape_under_compile():
    w13, w2, _, _ = random_weights()

    def f(x, logits):
        return torch.ops.atomc.moe(x, logits, w13, w2, None, None, None, None, 2) * 2

    x, logits = torch.randn(5, H), torch.randn(5, E)
    got = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)(x, logits)
    torch.testing.assert_close(got, torch.ops.atomc.moe(x, logits, w13, w2, None, None, None, None, 2) * 2)
