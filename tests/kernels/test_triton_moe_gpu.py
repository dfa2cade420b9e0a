"""The Triton fused MoE on CUDA in bf16 at the real shapes (Mixtral-8x7B, Qwen3-30B-A3B, GPT-OSS-20B)
against atomc's per-expert reference, both routes, plus determinism and CUDA-graph capture + replay."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

from triton_kernel_cases import DEEPSEEK_ROUTINGS, make_moe, rel_err, routing_lower_id_on_ties  # noqa: E402

from atomc.ops.moe import experts_reference, select_experts  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
REL = 2e-2  # bf16 activations rounded where the reference rounds them; different sum orders
# name: (experts, hidden, intermediate, top_k, activation, biases)
SHAPES = {
    "mixtral": (8, 4096, 14336, 2, "silu", False),
    "qwen3_moe": (128, 2048, 768, 8, "silu", False),
    "gpt_oss": (32, 2880, 2880, 4, "swiglu_oai", True),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def shape(request):
    e, h, inter, k, act, bias = SHAPES[request.param]
    _, _, w13, w2, b13, b2 = make_moe(1, e, h, inter, k, BF16, DEV, bias=bias, seed=1)
    yield dict(e=e, h=h, k=k, act=act, w13=w13, w2=w2, b13=b13, b2=b2)
    torch.cuda.empty_cache()


def inputs(s, t, seed=0, expert_map=None):
    g = torch.Generator(DEV).manual_seed(seed)
    x = torch.randn(t, s["h"], generator=g, device=DEV).to(BF16)
    logits = torch.randn(t, s["e"], generator=g, device=DEV)
    weights, ids = select_experts(logits, s["k"])
    w13, w2, b13, b2 = s["w13"], s["w2"], s["b13"], s["b2"]
    if expert_map is not None:  # this rank holds the first rows only
        n = int(expert_map.max()) + 1
        w13, w2 = w13[:n], w2[:n]
        b13, b2 = (None, None) if b13 is None else (b13[:n], b2[:n])
    return (x, weights, ids, w13, w2, b13, b2, expert_map, s["act"], 1.702, 7.0)


def kernels():
    from atomc.kernels.triton.moe import fused_experts

    return fused_experts


@pytest.mark.parametrize("t", [1, 4, 8, 64, 512, 2048])
def test_fused_moe_real_shapes(shape, t):
    args = inputs(shape, t, seed=t)
    out = kernels()(*args)
    ref = experts_reference(*args)
    assert not out.isnan().any()
    assert rel_err(out, ref) < REL


@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("path", ["gemv", "small", "sorted"])
def test_every_route_at_decode_batches(shape, path, t):
    from atomc.kernels.triton import moe_config

    if path == "gemv" and t != 1:
        pytest.skip("the gemv route takes one token")
    tokens = {"gemv": 1, "small": 2, "sorted": 4096}[path]  # a token count whose default is that route
    cfg = moe_config.default_config(tokens, shape["k"], shape["e"], shape["w2"].shape[2])
    assert cfg["path"] == path
    args = inputs(shape, t, seed=11)
    assert rel_err(kernels()(*args, config=cfg), experts_reference(*args)) < REL


def test_expert_map(shape):
    e = shape["e"]
    expert_map = torch.full((e,), -1, dtype=torch.int32, device=DEV)
    mine = torch.arange(0, e, 2, device=DEV)  # every other expert on this rank, as local rows 0..
    expert_map[mine] = torch.arange(mine.numel(), dtype=torch.int32, device=DEV)
    for t in (1, 300):
        args = inputs(shape, t, seed=5, expert_map=expert_map)
        assert rel_err(kernels()(*args), experts_reference(*args)) < REL


def test_deterministic(shape):
    args = inputs(shape, 256, seed=3)
    a, b = kernels()(*args), kernels()(*args)
    assert torch.equal(a, b)


def test_combine_in_the_down_kernel_at_one_token(shape, monkeypatch):
    """COMBINE_IN_DOWN_ONE_TOKEN: the small route's down kernel sums the experts; the same numbers
    as the combine kernel's run (equal expert rows, same slot order), in a CUDA graph replayed with
    new routing (its counters must be back at zero after every launch), and with half the experts
    on another rank."""
    from atomc.kernels.triton import moe, moe_config

    cfg = moe_config.default_config(2, shape["k"], shape["e"], shape["w2"].shape[2])
    args = inputs(shape, 1, seed=21)
    monkeypatch.setattr(moe, "COMBINE_IN_DOWN_ONE_TOKEN", False)
    apart = kernels()(*args, config=cfg)
    monkeypatch.setattr(moe, "COMBINE_IN_DOWN_ONE_TOKEN", True)
    torch.testing.assert_close(kernels()(*args, config=cfg), apart, rtol=1e-2, atol=1e-3)
    x, weights, ids = (a.clone() for a in args[:3])
    run = lambda: kernels()(x, weights, ids, *args[3:], config=cfg)  # noqa: E731
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for seed in (22, 23, 24):
        new = inputs(shape, 1, seed=seed)
        for buf, a in zip((x, weights, ids), new[:3], strict=True):
            buf.copy_(a)
        graph.replay()
        assert rel_err(out, experts_reference(*new)) < REL
    expert_map = torch.full((shape["e"],), -1, dtype=torch.int32, device=DEV)
    mine = torch.arange(0, shape["e"], 2, device=DEV)
    expert_map[mine] = torch.arange(mine.numel(), dtype=torch.int32, device=DEV)
    for seed in (25, 26):
        mapped = inputs(shape, 1, seed=seed, expert_map=expert_map)
        assert rel_err(kernels()(*mapped, config=cfg), experts_reference(*mapped)) < REL


@pytest.mark.parametrize("t", [1, 8, 256])
def test_cuda_graph_capture_and_replay(shape, t):
    from atomc.kernels.triton.moe import fused_moe

    s = shape
    g = torch.Generator(DEV).manual_seed(7)
    x = torch.randn(t, s["h"], generator=g, device=DEV).to(BF16)
    logits = torch.randn(t, s["e"], generator=g, device=DEV)  # fp32: no ties between experts' scores
    run = lambda: fused_moe(x, logits, s["w13"], s["w2"], s["b13"], s["b2"], None, None, s["k"], activation=s["act"])  # noqa: E731
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for seed in (8, 9):  # new tokens and new routing, same buffers
        g.manual_seed(seed)
        x.copy_(torch.randn(t, s["h"], generator=g, device=DEV))
        logits.copy_(torch.randn(t, s["e"], generator=g, device=DEV))
        graph.replay()
        weights, ids = select_experts(logits, s["k"])
        ref = experts_reference(x, weights, ids, s["w13"], s["w2"], s["b13"], s["b2"], None, s["act"], 1.702, 7.0)
        assert rel_err(out, ref) < REL


@pytest.mark.parametrize("e,k", [(8, 2), (128, 8), (32, 4)])
def test_softmax_topk_routing(e, k):
    from atomc.kernels.triton.moe_routing import softmax_topk

    logits = torch.randn(3000, e, device=DEV)
    weights, ids = softmax_topk(logits, k)
    ref_w, ref_ids = select_experts(logits, k)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-5)


# DeepSeek's routings on one launch (moe_routing.grouped_topk) against select_experts' torch chain:
# DeepSeek-V3 / R1's and V2's (the first two of DEEPSEEK_ROUTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("tokens", [1, 64, 300])
@pytest.mark.parametrize("e,k,scoring,bias,groups,keep,renormalize,scale", DEEPSEEK_ROUTINGS[:2])
def test_grouped_topk_on_cuda_matches_select_experts_up_to_ties(
    e, k, scoring, bias, groups, keep, renormalize, scale, tokens, dtype
):
    from atomc.kernels.triton.moe_routing import grouped_topk

    g = torch.Generator(DEV).manual_seed(e + tokens)
    logits = torch.randn(tokens, e, generator=g, device=DEV).to(dtype)
    correction = 0.1 * torch.randn(e, generator=g, device=DEV) if bias else None
    args = (k, scoring, renormalize, correction, groups, keep, scale)
    weights, ids = grouped_topk(logits, *args)
    # bf16 logits tie (V2's softmax without a bias: 6-8% of rows differed from select_experts on an
    # H100, whose torch.topk order among equal scores is unspecified); the kernel takes the lower id
    ref_w, ref_ids = routing_lower_id_on_ties(logits, *args)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-5, rtol=1e-4)
    if dtype == torch.float32:  # no ties: select_experts itself
        assert torch.equal(ids, select_experts(logits, *args)[1])
