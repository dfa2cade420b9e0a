"""`atomc_aiter::moe` against the `atomc::moe` reference, through the stand-in `aiter` (keyword-only,
AITER's argument names, asserting its shapes and dtypes): which AITER routing kernel each family's
scoring takes, the expert map through fused_moe's expert_mask, the calls that go to ROCm's next
backend, and the registry's lowering on a faked ROCm platform. CPU only: none of this has run on
AMD hardware."""

from __future__ import annotations

import sys

import fake_aiter
import pytest
import torch

from atomc.kernels import registry
from atomc.ops.moe import select_experts

E, K, H, INTER, T = 8, 2, 32, 24, 13


@pytest.fixture
def aiter_moe(monkeypatch):
    fake_aiter.install(monkeypatch)
    # ROCm without Triton: the next backend after AITER is the reference (as on this CPU)
    monkeypatch.setattr(registry, "backend_available", lambda backend: backend != "triton")
    registry.lookup("moe", "aiter")  # defines torch.ops.atomc_aiter.moe and sets its fallback
    return torch.ops.atomc_aiter.moe


def block(dtype=torch.float16, e_local=E, bias=False, seed=0, t=T):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).to(dtype)
    logits = torch.randn(t, E, generator=g).to(dtype)
    w13 = (torch.randn(e_local, 2 * INTER, H, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(e_local, H, INTER, generator=g) * 0.2).to(dtype)
    b13 = (torch.randn(e_local, 2 * INTER, generator=g) * 0.2).to(dtype) if bias else None
    b2 = (torch.randn(e_local, H, generator=g) * 0.2).to(dtype) if bias else None
    return x, logits, w13, w2, b13, b2


def both(op, x, logits, w13, w2, b13, b2, expert_map=None, correction_bias=None, top_k=K, **kw):
    args = (x, logits, w13, w2, b13, b2, expert_map, correction_bias, top_k)
    return op(*args, **kw), torch.ops.atomc.moe(*args, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_silu_matches_the_reference(aiter_moe, dtype, renormalize):
    got, want = both(aiter_moe, *block(dtype), renormalize=renormalize)
    assert got.dtype == dtype and got.shape == (T, H)
    tol = 2e-3 if dtype == torch.float16 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert fake_aiter.CALLS == ["topk_softmax", "fused_moe"]


def test_renormalisation_reaches_topk_softmax(aiter_moe):
    """The two settings must give different blocks (so the test above could fail on a dropped flag)."""
    args = block()
    on, off = aiter_moe(*args, None, None, K, renormalize=True), aiter_moe(*args, None, None, K, renormalize=False)
    assert (on.float() - off.float()).abs().max() > 1e-2


def test_shared_experts_reach_fused_moe_as_more_slots(aiter_moe):
    """DeepSeek's shared experts in the op (rows E, E+1 of the weights): fused_moe gets the routed
    slots and then ids E, E+1 with weight 1.0, and the block equals the reference's."""
    x, logits, w13, w2, _, _ = block(e_local=E + 2, seed=4)
    got, want = both(aiter_moe, x, logits, w13, w2, None, None, num_shared_experts=2)
    # four experts a token in fp16 (each output rounded before the sum): a few fp16 steps of ~1
    torch.testing.assert_close(got.float(), want.float(), atol=5e-3, rtol=5e-3)
    plain = torch.ops.atomc.moe(x, logits, w13, w2, None, None, None, None, K)
    assert (want.float() - plain.float()).abs().max() > 1e-2  # the shared rows took part


def test_expert_map_through_the_expert_mask(aiter_moe, monkeypatch):
    """Four of eight experts on this rank, their rows not in global order: the ids reach fused_moe as
    local rows, off-rank choices as the one masked id E_local, and the output is this rank's share."""
    expert_map = torch.tensor([-1, 2, -1, 0, 3, -1, 1, -1], dtype=torch.int32)
    seen = {}
    real = fake_aiter.fused_moe

    def record(**kw):
        seen.update(kw)
        return real(**kw)

    monkeypatch.setattr(sys.modules["aiter.fused_moe"], "fused_moe", record)
    args = block(e_local=4, seed=3)
    got, want = both(aiter_moe, *args, expert_map=expert_map)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-3)
    assert seen["expert_mask"].tolist() == [1, 1, 1, 1, 0] and seen["expert_mask"].dtype == torch.int32
    _, ids = select_experts(args[1], K)
    local = expert_map[ids.long()]
    assert torch.equal(seen["topk_ids"], torch.where(local >= 0, local, 4).int())
    assert (local < 0).any() and (local >= 0).any()  # some choices on each side of the split
    assert fake_aiter.CALLS == ["topk_softmax", "fused_moe"]


@pytest.mark.parametrize(
    "routing,call",
    [
        (dict(scoring="sigmoid", num_expert_group=4, topk_group=2, bias=True), "biased_grouped_topk"),
        (dict(scoring="softmax", num_expert_group=4, topk_group=2), "grouped_topk"),
        (dict(scoring="sigmoid", num_expert_group=2, topk_group=1, renormalize=False), "grouped_topk"),
        (dict(scoring="sigmoid"), None),  # no AITER kernel: select_experts, then fused_moe
        (dict(scoring="sigmoid", num_expert_group=4, topk_group=2, bias=True, renormalize=False), None),
    ],
)
def test_routing_kernel_per_family(aiter_moe, routing, call):
    routing = dict(routing)
    bias = torch.randn(E, generator=torch.Generator().manual_seed(7)).half() * 0.3
    bias = bias if routing.pop("bias", False) else None
    got, want = both(aiter_moe, *block(seed=5), correction_bias=bias, top_k=3, routed_scaling_factor=2.5, **routing)
    torch.testing.assert_close(got.float(), want.float(), atol=5e-3, rtol=5e-3)
    assert fake_aiter.CALLS == ([call] if call else []) + ["fused_moe"]


@pytest.mark.parametrize(
    "case",
    ["swiglu_oai", "silu_with_biases", "float32"],
)
def test_what_aiter_cannot_run_goes_to_the_next_backend(aiter_moe, case):
    """GPT-OSS's clamped SwiGLU with expert biases, biases alone, fp32: the reference here, no AITER call."""
    dtype = torch.float32 if case == "float32" else torch.float16
    args = block(dtype, bias=case != "float32", seed=2)
    kw = dict(activation="swiglu_oai", swiglu_alpha=1.702, swiglu_limit=0.5) if case == "swiglu_oai" else {}
    got, want = both(aiter_moe, *args, **kw)
    assert torch.equal(got, want)
    assert fake_aiter.CALLS == []


def test_the_fallback_is_the_next_available_backend(aiter_moe, monkeypatch):
    seen = []
    monkeypatch.setattr(registry, "backend_available", lambda backend: True)
    monkeypatch.setitem(registry._LOADERS, ("moe", "triton"), lambda: lambda *a: seen.append(a) or a[0].clone())
    x, *rest = block(torch.float32)
    assert aiter_moe(x, *rest, None, None, K) is not None and len(seen) == 1 and seen[0][8] == K


def test_no_tokens(aiter_moe):
    out = aiter_moe(*block(t=0), None, None, K)
    assert out.shape == (0, H) and fake_aiter.CALLS == []


def test_stand_in_refuses_what_aiter_refuses(monkeypatch):
    mod = fake_aiter.install(monkeypatch)
    x, logits, w13, w2, _, _ = block()
    ids = torch.zeros(T, K, dtype=torch.int32)
    w = torch.ones(T, K)
    ok = dict(hidden_states=x, w1=w13, w2=w2, topk_weight=w, topk_ids=ids,
              activation=mod.ActivationType.Silu, quant_type=mod.QuantType.No)  # fmt: skip
    mod.fused_moe.fused_moe(**ok)
    for bad in (dict(topk_ids=ids.long()), dict(topk_weight=w.half()), dict(activation=0),
                dict(w2=w2.transpose(1, 2).contiguous()), dict(hidden_states=x.float())):  # fmt: skip
        with pytest.raises(AssertionError):
            mod.fused_moe.fused_moe(**{**ok, **bad})
    with pytest.raises(TypeError):
        mod.fused_moe.fused_moe(x, w13, w2, w, ids)  # positional
    out = dict(topk_weights=torch.empty(T, K), topk_indices=torch.empty(T, K, dtype=torch.int32),
               token_expert_indices=torch.empty(T, K, dtype=torch.int32))  # fmt: skip
    mod.topk_softmax(**out, gating_output=logits, need_renorm=True)
    with pytest.raises(AssertionError):
        mod.topk_softmax(**{**out, "topk_indices": out["topk_indices"].long()}, gating_output=logits, need_renorm=True)


def test_rocm_lowers_moe_to_aiter(monkeypatch):
    """A traced graph's atomc::moe becomes atomc_aiter::moe on ROCm (Triton next, torch last)."""
    from atomc.passes.lowering import Lowering

    fake_aiter.install(monkeypatch)
    monkeypatch.setattr(registry, "backend_available", lambda backend: True)
    assert registry.choose("moe", "rocm") == ("aiter", torch.ops.atomc_aiter.moe.default)
    assert "atomc.kernels.aiter.moe" in registry.chosen_modules("rocm")

    x, logits, w13, w2, _, _ = block()

    def f(x, logits, w13, w2):
        return torch.ops.atomc.moe(x, logits, w13, w2, None, None, None, None, K)

    gm = torch.fx.symbolic_trace(f)
    result = Lowering("rocm")(gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.atomc_aiter.moe.default] and result.rewritten == 1
    gm.recompile()
    fake_aiter.CALLS.clear()
    torch.testing.assert_close(gm(x, logits, w13, w2).float(), f(x, logits, w13, w2).float(), atol=2e-3, rtol=2e-3)
    assert fake_aiter.CALLS == ["topk_softmax", "fused_moe"]
    monkeypatch.setattr(registry, "backend_available", lambda backend: backend == "torch")
    assert registry.choose("moe", "rocm")[0] == "torch"
