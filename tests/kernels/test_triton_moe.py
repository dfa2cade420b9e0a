"""The Triton fused MoE (atomc/kernels/triton/moe*.py) against atomc's per-expert reference on CPU,
through the Triton interpreter (fp32 and fp16: the interpreter mishandles bf16). Both routes (few
pairs without a sort, many pairs sorted by expert), both activations, biases, an expert map, experts
that receive no token. Shapes are tiny and not powers of two, so every tile edge is masked."""

import importlib

import pytest
import torch
from triton_interpreter import use_interpreter

use_interpreter()  # before the first triton import; test_triton_moe_gpu.py covers CUDA

triton = pytest.importorskip("triton")
from triton_kernel_cases import (  # noqa: E402
    DEEPSEEK_ROUTINGS,
    LaunchRecorder,
    make_moe,
    rel_err,
    routing_lower_id_on_ties,
)

from atomc.kernels.triton import arrivals, moe_config  # noqa: E402
from atomc.kernels.triton.moe import fused_experts  # noqa: E402
from atomc.kernels.triton.moe_align import align_by_expert, max_padded_rows  # noqa: E402
from atomc.ops.moe import experts_reference, select_experts  # noqa: E402

E, H, INTER, K = 6, 48, 40, 2
TOL = {torch.float32: 1e-5, torch.float16: 3e-3}
TILE = dict(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)
SMALL = {"path": "small", "gate_up": dict(TILE), "down": dict(TILE)}
SORTED = {"path": "sorted", "gate_up": dict(TILE), "down": dict(TILE)}
GEMV = {"path": "gemv", "gate_up": dict(TILE, block_n=4, block_k=16), "down": dict(TILE, block_n=2, block_k=32)}
# the one-token route with the combine as its own kernel (the default does it in the down GEMV)
GEMV_UNFUSED = {**GEMV, "down": dict(GEMV["down"], fuse_combine=False)}


def check(t, dtype, config, *, activation="silu", bias=False, expert_map=None, e=E, k=K, skewed=False, seed=0):
    x, logits, w13, w2, b13, b2 = make_moe(t, e, H, INTER, k, dtype, "cpu", bias=bias, seed=seed, skewed=skewed)
    weights, ids = select_experts(logits, k)
    if expert_map is not None:  # this rank holds only the mapped experts' rows
        w13, w2 = w13[: int(expert_map.max()) + 1], w2[: int(expert_map.max()) + 1]
        b13, b2 = (None, None) if not bias else (b13[: w13.shape[0]], b2[: w13.shape[0]])
    args = (x, weights, ids, w13, w2, b13, b2, expert_map, activation, 1.702, 7.0)
    out = fused_experts(*args, config=config)
    ref = experts_reference(*args)
    assert out.shape == x.shape and out.dtype == dtype and not out.isnan().any()
    assert rel_err(out, ref) < TOL[dtype], rel_err(out, ref)
    return out, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation,bias", [("silu", False), ("swiglu_oai", True), ("silu", True)])
@pytest.mark.parametrize("t", [1, 5, 32])
def test_small_route_matches_reference(t, dtype, activation, bias):
    check(t, dtype, SMALL, activation=activation, bias=bias, seed=t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation,bias", [("silu", False), ("swiglu_oai", True), ("silu", True)])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("config", [GEMV, GEMV_UNFUSED], ids=["fused-combine", "combine-kernel"])
def test_gemv_route_matches_reference(k, dtype, activation, bias, config):
    check(1, dtype, config, activation=activation, bias=bias, k=k, seed=k)


def test_gemv_fused_combine_equals_the_combine_kernel():
    # same rounding and the same slot order: the two one-token variants agree to fp32 rounding of one sum
    x, logits, w13, w2, b13, b2 = make_moe(1, E, H, INTER, 4, torch.float32, "cpu", bias=True, seed=5)
    args = (x, *select_experts(logits, 4), w13, w2, b13, b2)
    torch.testing.assert_close(fused_experts(*args, config=GEMV), fused_experts(*args, config=GEMV_UNFUSED))


@pytest.fixture
def combine_in_down(monkeypatch):
    """COMBINE_IN_DOWN_ONE_TOKEN on; yields the list of combine-kernel launches."""
    moe = importlib.import_module("atomc.kernels.triton.moe")
    monkeypatch.setattr(moe, "COMBINE_IN_DOWN_ONE_TOKEN", True)
    launched = []
    monkeypatch.setattr(moe, "moe_combine_kernel", LaunchRecorder(moe.moe_combine_kernel, launched))
    yield launched
    assert not arrivals.counters(torch.device("cpu"), "moe_down_combine").any(), "counters left for the next launch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation,bias", [("silu", False), ("swiglu_oai", True)])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_small_route_combines_in_the_down_kernel_at_one_token(combine_in_down, k, dtype, activation, bias):
    # H 48 over 32-column tiles: two tiles, the second half masked; each tile's last program sums
    check(1, dtype, SMALL, activation=activation, bias=bias, k=k, seed=10 + k)
    assert combine_in_down == []
    check(3, dtype, SMALL, activation=activation, bias=bias, k=k, seed=20 + k)  # more tokens: the combine kernel
    assert len(combine_in_down) == 1


def test_combine_in_down_equals_the_combine_kernel(monkeypatch):
    # the same bf16-rounded expert rows summed in the same slot order: equal to fp32 rounding
    moe = importlib.import_module("atomc.kernels.triton.moe")
    x, logits, w13, w2, b13, b2 = make_moe(1, E, H, INTER, 4, torch.float32, "cpu", bias=True, seed=5)
    args = (x, *select_experts(logits, 4), w13, w2, b13, b2)
    monkeypatch.setattr(moe, "COMBINE_IN_DOWN_ONE_TOKEN", False)
    apart = fused_experts(*args, config=SMALL)
    monkeypatch.setattr(moe, "COMBINE_IN_DOWN_ONE_TOKEN", True)
    torch.testing.assert_close(fused_experts(*args, config=SMALL), apart)


def test_combine_in_down_with_experts_on_other_ranks(combine_in_down):
    # one token choosing 3 of 6 experts; this rank holds 1 and 4: some seeds pick none of them,
    # and then no program arrives and the token's share must still be exactly zero
    expert_map = torch.tensor([-1, 0, -1, -1, 1, -1], dtype=torch.int32)
    none_here = 0
    for seed in range(8):
        out, _ = check(1, torch.float32, SMALL, bias=True, expert_map=expert_map, k=3, seed=seed)
        _, ids = select_experts(make_moe(1, E, H, INTER, 3, torch.float32, "cpu", bias=True, seed=seed)[1], 3)
        if (expert_map[ids.long()] < 0).all():
            none_here += 1
            assert (out == 0).all()
    assert none_here > 0, "some seed must route the token to experts of other ranks only"
    assert combine_in_down == []


def test_gemv_route_takes_one_token():
    x, logits, w13, w2, _, _ = make_moe(2, E, H, INTER, K, torch.float32, "cpu")
    with pytest.raises(ValueError, match="one token"):
        fused_experts(x, *select_experts(logits, K), w13, w2, config=GEMV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation,bias", [("silu", False), ("swiglu_oai", True)])
@pytest.mark.parametrize("t", [1, 7, 60, 300])
def test_sorted_route_matches_reference(t, dtype, activation, bias):
    check(t, dtype, SORTED, activation=activation, bias=bias, seed=t)


@pytest.mark.parametrize("config", [SMALL, SORTED], ids=["small", "sorted"])
def test_experts_without_tokens(config):
    out, _ = check(9, torch.float16, config, skewed=True, k=2)
    _, ids = select_experts(make_moe(9, E, H, INTER, K, torch.float16, "cpu", skewed=True)[1], K)
    assert set(ids.unique().tolist()) <= set(range(E // 2)), "the skew must leave experts without tokens"


@pytest.mark.parametrize("config", [SMALL, SORTED], ids=["small", "sorted"])
def test_expert_map_drops_experts_on_other_ranks(config):
    # global experts 0..5; this rank holds 1, 4 and 5 as local rows 0, 1, 2
    expert_map = torch.tensor([-1, 0, -1, -1, 1, 2], dtype=torch.int32)
    out, ref = check(20, torch.float32, config, bias=True, expert_map=expert_map, seed=3)
    # a token whose chosen experts all live elsewhere gets exactly zero
    weights, ids = select_experts(make_moe(20, E, H, INTER, K, torch.float32, "cpu", bias=True, seed=3)[1], K)
    elsewhere = (expert_map[ids.long()] < 0).all(dim=1)
    assert elsewhere.any() and (out[elsewhere] == 0).all()


def test_expert_map_on_the_gemv_route():
    # one token choosing 3 of 6 experts; this rank holds experts 1 and 4 only
    expert_map = torch.tensor([-1, 0, -1, -1, 1, -1], dtype=torch.int32)
    for seed in range(4):
        for config in (GEMV, GEMV_UNFUSED):
            check(1, torch.float32, config, bias=True, expert_map=expert_map, k=3, seed=seed)


def test_more_experts_and_top_k():
    check(12, torch.float16, SMALL, e=16, k=4, seed=1)  # 48 pairs, the small route's tile is 64 rows
    check(40, torch.float16, SORTED, e=16, k=4, seed=1)
    check(9, torch.float16, SMALL, e=16, k=3, seed=2)  # k not a power of two: padded slot lanes


@pytest.mark.parametrize("block_m", [16, 32])
def test_align_by_expert_layout(block_m):
    local = torch.tensor([3, 0, 3, -1, 1, 3, 0, -1, 3, 3], dtype=torch.int32)
    experts = 5
    sorted_ids, block_expert, num_padded = align_by_expert(local, experts, block_m)
    p = local.numel()
    assert sorted_ids.numel() == max_padded_rows(p, experts, block_m) == block_expert.numel() * block_m
    used = int(num_padded)
    assert used == 3 * block_m  # experts 0, 1, 3 each pad to one block; 2 and 4 get none
    blocks = sorted_ids[:used].view(-1, block_m)
    for b, e in enumerate(block_expert[: used // block_m].tolist()):
        real = blocks[b][blocks[b] < p]
        assert (local[real.long()] == e).all()
        assert real.tolist() == sorted(real.tolist())  # stable: pairs keep their order
    assert sorted(sorted_ids[sorted_ids < p].tolist()) == [i for i in range(p) if local[i] >= 0]
    assert (block_expert[used // block_m :] == experts).all()


def test_the_route_follows_the_pair_count():
    k = 8
    small = moe_config.SMALL_PATH_MAX_PAIRS // k
    assert moe_config.pick_config(1, 128, 2048, 768, k, torch.bfloat16, "none")["path"] == "gemv"
    assert moe_config.pick_config(2, 128, 2048, 768, k, torch.bfloat16, "none")["path"] == "small"
    assert moe_config.pick_config(small, 128, 2048, 768, k, torch.bfloat16, "none")["path"] == "small"
    assert moe_config.pick_config(small + 1, 128, 2048, 768, k, torch.bfloat16, "none")["path"] == "sorted"


def test_default_route_end_to_end():
    # no config given: the default picks the route; 1 token (small) and 64 tokens (sorted)
    for t in (1, 64):
        check(t, torch.float16, None, seed=t)


def test_tuned_file_buckets(tmp_path):
    name = moe_config.config_name(E, H, INTER, K, torch.float16, "Some GPU")
    tiles = lambda bn: dict(block_m=16, block_n=bn, block_k=32, num_warps=4, num_stages=2)  # noqa: E731
    buckets = {"1": {"path": "small", "gate_up": tiles(16), "down": tiles(16)},
               "64": {"gate_up": tiles(64), "down": tiles(64)}}  # fmt: skip
    (tmp_path / name).write_text(__import__("json").dumps({"buckets": buckets}))
    pick = lambda t: moe_config.pick_config(t, E, H, INTER, K, torch.float16, "Some GPU", tmp_path)  # noqa: E731
    assert pick(1)["gate_up"]["block_n"] == 16 and pick(1)["path"] == "small"
    assert pick(20)["gate_up"]["block_n"] == 16  # the largest bucket <= M
    assert pick(63)["path"] == "sorted"  # 126 pairs: more than a small-route tile holds, whatever the file says
    assert pick(500)["gate_up"]["block_n"] == 64 and pick(500)["path"] == "sorted"
    assert " " not in name and "/" not in name


def test_backend_op_matches_the_atomc_op():
    import atomc.kernels.triton.ops  # noqa: F401  (defines torch.ops.atomc_triton.moe)

    for t in (3, 70):
        x, logits, w13, w2, b13, b2 = make_moe(t, E, H, INTER, K, torch.float16, "cpu", bias=True, seed=t)
        args = (x, logits, w13, w2, b13, b2, None, None, K)
        kw = dict(activation="swiglu_oai", swiglu_alpha=1.5, swiglu_limit=2.0)
        out = torch.ops.atomc_triton.moe(*args, **kw)
        ref = torch.ops.atomc.moe(*args, **kw)
        assert rel_err(out, ref) < TOL[torch.float16]


def test_bad_shapes_are_named():
    x, logits, w13, w2, _, _ = make_moe(2, E, H, INTER, K, torch.float32, "cpu")
    weights, ids = select_experts(logits, K)
    with pytest.raises(ValueError, match="do not fit"):
        fused_experts(x, weights, ids, w13, w2[:, :, :-1])


def test_tuned_configs_stay_out_of_the_compile_cache_key():
    """A tuned file changes only how the kernels launch, never the graph: adding one must not change
    the lowering's hashed sources (so it does not force a recompile), while the kernel code is hashed."""
    from atomc.graphs.cache_key import source_factors
    from atomc.passes.lowering import Lowering

    files = Lowering("cuda").source_files()
    before = source_factors([], files)
    assert "atomc/kernels/triton/moe_gemm.py" in before and "atomc/kernels/triton/moe_config.py" in before
    moe_config.CONFIG_DIR.mkdir(exist_ok=True)
    probe = moe_config.CONFIG_DIR / "E=1,H=1,I=1,topk=1,dtype=float16,device=probe.json"
    probe.write_text('{"buckets": {}}')
    try:
        assert source_factors([], files) == before
    finally:
        probe.unlink()
    assert not any(path.endswith(".json") for path in before)


def test_cuda_lowers_moe_to_triton():
    from atomc.kernels import registry

    backend, op = registry.choose("moe", "cuda")
    assert backend == "triton" and op is torch.ops.atomc_triton.moe.default
    assert registry.choose("moe", "cpu")[0] == "torch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("e,k,renormalize,scale", [(6, 2, True, 1.0), (128, 8, False, 1.0), (60, 3, True, 2.5)])
def test_softmax_topk_matches_select_experts(dtype, e, k, renormalize, scale):
    from atomc.kernels.triton.moe_routing import softmax_topk

    logits = torch.randn(11, e, generator=torch.Generator().manual_seed(e)).to(dtype)
    weights, ids = softmax_topk(logits, k, renormalize, scale)
    ref_w, ref_ids = select_experts(logits, k, "softmax", renormalize, None, 0, 0, scale)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-5)


def test_softmax_topk_ties_go_to_the_lower_expert():
    from atomc.kernels.triton.moe_routing import softmax_topk

    logits = torch.tensor([[0.0, 1.0, 0.5, 1.0, 1.0, 0.5, -1.0, 0.0]])
    weights, ids = softmax_topk(logits, 4, False)
    assert ids.tolist() == [[1, 3, 4, 2]]
    assert weights[0, 0] == weights[0, 1] == weights[0, 2] > weights[0, 3]


@pytest.mark.parametrize("e,k,scoring,bias,groups,keep,renormalize,scale", DEEPSEEK_ROUTINGS)
def test_grouped_topk_matches_select_experts(e, k, scoring, bias, groups, keep, renormalize, scale):
    from atomc.kernels.triton.moe_routing import grouped_topk

    g = torch.Generator().manual_seed(e + k)
    logits = torch.randn(9, e, generator=g)
    correction = 0.1 * torch.randn(e, generator=g) if bias else None
    args = (k, scoring, renormalize, correction, groups, keep, scale)
    weights, ids = grouped_topk(logits, *args)
    ref_w, ref_ids = select_experts(logits, *args)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-5)
    if groups > 1:  # every chosen expert lies in one of the kept groups: at most `keep` groups hit
        assert max(len(set((ids[t] // (e // groups)).tolist())) for t in range(9)) <= keep


@pytest.mark.parametrize("e,k,scoring,bias,groups,keep,renormalize,scale", DEEPSEEK_ROUTINGS)
def test_grouped_topk_over_tied_scores_takes_the_lower_id(e, k, scoring, bias, groups, keep, renormalize, scale):
    # logits on the bf16 grid tie often (V2's softmax routing, no bias: rows where torch.topk kept the
    # higher of two equal experts or groups on an H100); the kernel keeps the lower one, every time
    from atomc.kernels.triton.moe_routing import grouped_topk

    g = torch.Generator().manual_seed(224 + e)
    logits = torch.randn(64, e, generator=g).to(torch.bfloat16).float()
    correction = 0.1 * torch.randn(e, generator=g) if bias else None
    args = (k, scoring, renormalize, correction, groups, keep, scale)
    weights, ids = grouped_topk(logits, *args)
    ref_w, ref_ids = routing_lower_id_on_ties(logits, *args)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-5)


def test_grouped_topk_refuses_what_it_does_not_take():
    from atomc.kernels.triton.moe_routing import grouped_topk

    with pytest.raises(ValueError, match="groups"):
        grouped_topk(torch.randn(2, 30), 2, "sigmoid", True, None, 8, 4, 1.0)  # 30 experts in 8 groups


def test_route_takes_the_grouped_kernel_when_on(monkeypatch):
    from atomc.kernels.triton import moe_routing

    logits, bias = torch.randn(5, 64), 0.1 * torch.randn(64)
    args = (logits, 6, "sigmoid", True, bias, 8, 3, 2.5)
    calls = []
    monkeypatch.setattr(moe_routing, "grouped_topk", lambda *a: calls.append(a) or select_experts(*a[:8]))
    monkeypatch.setattr(moe_routing, "GROUPED_KERNEL", False)
    moe_routing.route(*args)
    assert not calls  # off: select_experts
    monkeypatch.setattr(moe_routing, "GROUPED_KERNEL", True)
    weights, ids = moe_routing.route(*args)
    assert len(calls) == 1 and torch.equal(ids, select_experts(*args)[1])
    moe_routing.route(torch.randn(2, 2048), 2, "sigmoid", True, None, 0, 0, 1.0)  # past MAX_EXPERTS: select_experts
    assert len(calls) == 1


@pytest.mark.parametrize("kernel", ["softmax", "grouped", "select_experts"])
@pytest.mark.parametrize("shared", [1, 2, 3])
def test_routing_appends_the_shared_expert_slots(kernel, shared, monkeypatch):
    """The routing kernels write the shared slots (ids E.., weight 1.0) after the routed ones, which
    stay as without them: the contract of atomc/ops/moe.py's append_shared_experts."""
    from atomc.kernels.triton import moe_routing

    e, k = 16, 3
    logits = torch.randn(7, e, generator=torch.Generator().manual_seed(shared))
    args = {"softmax": (logits, k, "softmax", True, None, 0, 0, 1.0),
            "grouped": (logits, k, "sigmoid", True, 0.1 * torch.ones(e), 4, 2, 2.5),
            "select_experts": (logits, k, "sigmoid", False, None, 4, 2, 1.5)}[kernel]  # fmt: skip
    monkeypatch.setattr(moe_routing, "GROUPED_KERNEL", kernel == "grouped")
    weights, ids = moe_routing.route(*args, shared)
    plain_w, plain_ids = moe_routing.route(*args)
    assert ids.shape == weights.shape == (7, k + shared) and ids.dtype == torch.int32
    assert torch.equal(ids[:, :k], plain_ids) and torch.equal(weights[:, :k], plain_w)
    assert ids[:, k:].tolist() == [list(range(e, e + shared))] * 7
    assert torch.equal(weights[:, k:], torch.ones(7, shared))


@pytest.mark.parametrize("config", [GEMV, SMALL, SORTED], ids=["gemv", "small", "sorted"])
def test_shared_experts_ride_in_the_fused_op(config):
    """atomc::moe with two shared experts on the Triton kernels against its reference, on each route."""
    from atomc.kernels.triton.moe import fused_moe

    t = 1 if config is GEMV else 9
    x, logits, w13, w2, _, _ = make_moe(t, E + 2, H, INTER, K, torch.float32, "cpu", seed=3)
    logits = logits[:, :E]  # the router scores the routed experts only; rows E, E+1 are the shared ones
    args = (x, logits, w13, w2, None, None, None, None, K, "softmax", True, 0, 0, 1.0, "silu", 1.702, 7.0, 2)
    ref = torch.ops.atomc.moe(*args)
    weights, ids = select_experts(logits, K)
    ids = torch.cat([ids, torch.tensor([[E, E + 1]] * t, dtype=torch.int32)], 1)
    weights = torch.cat([weights, torch.ones(t, 2)], 1)
    out = fused_experts(x, weights, ids, w13, w2, config=config, num_shared=2)
    assert rel_err(out, ref) < TOL[torch.float32], rel_err(out, ref)
    assert rel_err(fused_moe(*args), ref) < TOL[torch.float32]
    assert rel_err(ref, torch.ops.atomc.moe(*args[:-1])) > 0.05  # the shared experts add to every token


def test_routing_choice():
    from atomc.kernels.triton.moe_routing import handles

    assert handles("softmax", None, 0, 128)
    assert not handles("sigmoid", None, 0, 256)  # DeepSeek-V3 stays on select_experts
    assert not handles("softmax", torch.zeros(8), 0, 8) and not handles("softmax", None, 4, 64)
