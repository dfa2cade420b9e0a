"""FusedMoE loads its own weights: per-expert tensors (by shard id) and fused stacks give the same
parameters; a tensor-parallel rank holds its slice of I and an expert-parallel rank its experts,
and the ranks' partial outputs sum to the whole block's (one process: sharding is a pure function
of rank and size)."""

from __future__ import annotations

import pytest
import torch

from models.layers.moe import ExpertNames, FusedMoE, MoESpec, SparseMoEBlock
from models.layers.parallel import SINGLE, ParallelInfo

E, K, H, INTER, T = 8, 2, 16, 12, 11


def expert_tensors(seed=0, bias=False):
    """Per-expert checkpoint tensors {(expert, part): tensor} (+ biases under key (expert, part, "bias"))."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(E):
        out[(e, "gate")] = torch.randn(INTER, H, generator=g) * 0.3
        out[(e, "up")] = torch.randn(INTER, H, generator=g) * 0.3
        out[(e, "down")] = torch.randn(H, INTER, generator=g) * 0.3
        if bias:
            out[(e, "gate", "bias")] = torch.randn(INTER, generator=g) * 0.1
            out[(e, "up", "bias")] = torch.randn(INTER, generator=g) * 0.1
            out[(e, "down", "bias")] = torch.randn(H, generator=g) * 0.1
    return out


def build(bias=False, tp=SINGLE, ep=SINGLE, **routing) -> FusedMoE:
    return FusedMoE(H, MoESpec(E, K, INTER, expert_bias=bias, **routing), tp, ep)


def load_per_expert(moe: FusedMoE, tensors: dict) -> FusedMoE:
    for key, t in tensors.items():
        e, part = key[0], key[1]
        prefix = "w2" if part == "down" else "w13"
        param = getattr(moe, f"{prefix}_{'bias' if len(key) == 3 else 'weight'}")
        param.weight_loader(param, t, (e, part))
    return moe


def fused(tensors: dict, kind="weight") -> tuple[torch.Tensor, torch.Tensor]:
    sfx = () if kind == "weight" else ("bias",)
    w13 = torch.stack([torch.cat([tensors[(e, "gate", *sfx)], tensors[(e, "up", *sfx)]]) for e in range(E)])
    w2 = torch.stack([tensors[(e, "down", *sfx)] for e in range(E)])
    return w13, w2


def inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g), torch.randn(T, E, generator=g)


def test_per_expert_tensors_land_in_the_stacks():
    t = expert_tensors()
    moe = load_per_expert(build(), t)
    assert moe.expert_map is None  # EP size 1: no lookup in the op
    for e in range(E):
        assert torch.equal(moe.w13_weight[e, :INTER], t[(e, "gate")])
        assert torch.equal(moe.w13_weight[e, INTER:], t[(e, "up")])
        assert torch.equal(moe.w2_weight[e], t[(e, "down")])


def test_fused_stacks_load_like_per_expert_tensors_with_biases():
    t = expert_tensors(bias=True)
    a = load_per_expert(build(bias=True), t)
    b = build(bias=True)
    for kind in ("weight", "bias"):
        w13, w2 = fused(t, kind)
        for name, src in ((f"w13_{kind}", w13), (f"w2_{kind}", w2)):
            p = getattr(b, name)
            p.weight_loader(p, src, None)
            assert torch.equal(p, getattr(a, name))
    x, logits = inputs()
    torch.testing.assert_close(a(x, logits), b(x, logits))


@pytest.mark.parametrize("bias", [False, True])
def test_tp2_ranks_hold_their_slice_of_i_and_sum_to_the_whole(bias):
    t = expert_tensors(bias=bias)
    whole = load_per_expert(build(bias), t)
    ranks = [load_per_expert(build(bias, tp=ParallelInfo(r, 2)), t) for r in (0, 1)]
    n = INTER // 2
    for r, moe in enumerate(ranks):
        assert moe.w13_weight.shape == (E, 2 * n, H) and moe.w2_weight.shape == (E, H, n)
        for e in (0, 5):
            assert torch.equal(moe.w13_weight[e, :n], t[(e, "gate")][r * n : (r + 1) * n])
            assert torch.equal(moe.w13_weight[e, n:], t[(e, "up")][r * n : (r + 1) * n])
            assert torch.equal(moe.w2_weight[e], t[(e, "down")][:, r * n : (r + 1) * n])
    # a fused stack cuts the same slices
    w13, w2 = fused(t)
    f = build(bias, tp=ParallelInfo(1, 2))
    f.w13_weight.weight_loader(f.w13_weight, w13, None)
    f.w2_weight.weight_loader(f.w2_weight, w2, None)
    assert torch.equal(f.w13_weight, ranks[1].w13_weight) and torch.equal(f.w2_weight, ranks[1].w2_weight)
    x, logits = inputs()
    summed = sum(m.partial_forward(x, logits) for m in ranks)  # w2's bias only on rank 0
    torch.testing.assert_close(summed, whole(x, logits), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="collective group 'tp' is not set up"):  # outside a worker
        ranks[0](x, logits)


def test_ep2_expert_map_and_ranks_sum_to_the_whole():
    t = expert_tensors()
    whole = load_per_expert(build(), t)
    ranks = [load_per_expert(build(ep=ParallelInfo(r, 2)), t) for r in (0, 1)]
    assert ranks[0].expert_map.tolist() == [0, 1, 2, 3, -1, -1, -1, -1]
    assert ranks[1].expert_map.tolist() == [-1, -1, -1, -1, 0, 1, 2, 3]
    assert ranks[1].w13_weight.shape == (E // 2, 2 * INTER, H)
    assert torch.equal(ranks[1].w2_weight[2], t[(6, "down")])  # rank 1 holds experts 4..7
    x, logits = inputs()
    parts = [m.partial_forward(x, logits) for m in ranks]
    assert all(p.abs().sum() > 0 for p in parts)  # both ranks' experts were chosen
    torch.testing.assert_close(parts[0] + parts[1], whole(x, logits), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="collective group 'tp' is not set up"):
        ranks[0](x, logits)


def test_expert_map_survives_the_meta_build():
    from models.loader.safetensors import materialize

    with torch.device("meta"):
        moe = build(ep=ParallelInfo(1, 4))
    materialize(moe, "cpu")
    assert moe.expert_map.tolist() == [-1, -1, 0, 1, -1, -1, -1, -1]  # rank 1 of 4: experts 2, 3


@pytest.mark.parametrize(
    "param, tensor, shard, match",
    [
        ("w13_weight", torch.zeros(INTER + 1, H), (0, "gate"), r"dim 0 should be 12 \(expert 0 gate\)"),
        ("w2_weight", torch.zeros(H, INTER), (0, "up"), "does not belong in w2_weight"),
        ("w13_weight", torch.zeros(INTER, H), (8, "up"), "expert 8 is out of range"),
        ("w13_weight", torch.zeros(E - 1, 2 * INTER, H), None, "holds all 8 experts"),
        ("w2_weight", torch.zeros(E, H + 1, INTER), None, r"has shape \(17, 12\), the model expects \(16, 12\)"),
    ],
)
def test_wrong_tensors_are_clear_errors(param, tensor, shard, match):
    moe = build()
    p = getattr(moe, param)
    with pytest.raises(ValueError, match=match):
        p.weight_loader(p, tensor, shard)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(scoring="relu"), "scoring 'relu' is not supported"),
        (dict(activation="gelu"), "activation 'gelu' is not supported"),
        (dict(top_k=9), "top_k=9 must be between 1 and the number of experts"),
    ],
)
def test_spec_errors_at_build(kw, match):
    args = dict(num_experts=E, top_k=K, intermediate_size=INTER) | kw
    with pytest.raises(ValueError, match=match):
        MoESpec(**args)


def test_experts_must_divide_across_ep_ranks():
    with pytest.raises(ValueError, match="8 experts do not divide across 3 expert-parallel ranks"):
        build(ep=ParallelInfo(0, 3))


def test_block_routes_through_its_gate():
    block = SparseMoEBlock(H, MoESpec(E, K, INTER))
    load_per_expert(block.experts, expert_tensors())
    block.gate.weight.data.normal_()
    x, _ = inputs()
    want = torch.ops.atomc.moe(x, x @ block.gate.weight.T, block.experts.w13_weight, block.experts.w2_weight,
                               None, None, None, None, K)  # fmt: skip
    torch.testing.assert_close(block(x), want)


def test_expert_names_map_both_ways():
    names = ExpertNames({"w1": "gate", "w3": "up", "w2": "down"})
    hit = names.to_param("model.layers.0.mlp.experts.3.w3.weight".split("."))
    assert hit == ("model.layers.0.mlp.experts.w13_weight", (3, "up"))
    assert names.to_param("model.layers.0.mlp.experts.5.w2.bias".split(".")) == (
        "model.layers.0.mlp.experts.w2_bias",
        (5, "down"),
    )
    assert names.to_param("model.layers.0.mlp.experts.gate_up_proj".split(".")) == (
        "model.layers.0.mlp.experts.w13_weight",
        None,
    )
    assert names.to_param("model.layers.0.mlp.gate.weight".split(".")) is None
    pre = "model.layers.0.mlp.experts."
    assert names.to_checkpoint(pre + "w13_weight", (3, "up")) == pre + "3.w3.weight"
    assert names.to_checkpoint(pre + "w2_weight", None) == pre + "down_proj"
    with pytest.raises(ValueError, match="must name each of"):
        ExpertNames({"w1": "gate", "w2": "down"})
