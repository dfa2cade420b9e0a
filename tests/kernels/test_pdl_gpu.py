"""PDL on the GPU (Hopper and later): a decode-like chain of the PDL-aware kernels (norm, reduce GEMV,
RoPE + KV write, paged attention, router top-k, fused experts at one token, FP8 quant and the FP8
tensor-core GEMV), captured in a CUDA
graph and replayed on fresh inputs, gives the same bits with PDL on as with it off. A kernel that
read its producer's output before the producer finished would read the previous replay's values."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.version.hip or torch.cuda.get_device_capability()[0] < 9,
        reason="needs a CUDA GPU of compute capability 9.0 or more",
    ),
]

from triton_kernel_cases import cos_sin_cache, make_batch, make_moe  # noqa: E402

from atomc.kernels.triton import (  # noqa: E402
    fp8_quant,
    fused_add_rms_norm,
    paged_attention,
    pdl,
    rms_norm,
    rope_and_write_kv,
    silu_and_mul,
)
from atomc.kernels.triton.fp8_gemv import fp8_gemv  # noqa: E402
from atomc.kernels.triton.gemv import linear  # noqa: E402
from atomc.kernels.triton.moe import fused_experts  # noqa: E402
from atomc.kernels.triton.moe_routing import softmax_topk  # noqa: E402

DEV, BF16 = "cuda", torch.bfloat16
H, HQ, HKV, D, E, INTER, TOPK, LAYERS = 2048, 32, 4, 128, 128, 768, 8, 6


@pytest.fixture(scope="module")
def model():
    g = torch.Generator(DEV).manual_seed(0)

    def w(*shape, scale=0.02):
        return (torch.randn(*shape, generator=g, device=DEV) * scale).to(BF16)

    layers = []
    for i in range(LAYERS):
        _, _, w13, w2, _, _ = make_moe(1, E, H, INTER, TOPK, BF16, DEV, seed=i)
        layers.append(dict(norm=1 + w(H), qkv=w((HQ + 2 * HKV) * D, H), o=w(H, HQ * D), post=1 + w(H),
                           router=w(E, H, scale=0.1), w13=w13, w2=w2,
                           gate_up=w(2 * 1024, H), down=w(H, 1024),
                           fp8=torch.randn(H, H, generator=g, device=DEV).to(torch.float8_e4m3fn),
                           fp8_scale=torch.full((H,), H**-0.5, device=DEV)))  # fmt: skip
    # one sequence at 300 cached tokens plus this step's; the cache is shared by the layers
    q, k_cache, v_cache, meta = make_batch([1], [301], HQ, HKV, D, BF16, DEV, pad_tokens=0)
    return dict(layers=layers, k_cache=k_cache, v_cache=v_cache, meta=meta, cs=cos_sin_cache(4096, D, DEV).to(BF16))


def step(m, x, positions, slots):
    meta, res = m["meta"], x.clone()
    h = rms_norm(x, m["layers"][0]["norm"], 1e-6)
    for lw in m["layers"]:
        qkv = linear(h, lw["qkv"])
        q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
        q, k = q.reshape(1, HQ, D), k.reshape(1, HKV, D)
        q, k = rope_and_write_kv(positions, q, k, v.reshape(1, HKV, D), m["cs"], m["k_cache"], m["v_cache"], slots,
                                 out=(torch.empty_like(q), torch.empty_like(k)))  # fmt: skip
        attn = torch.empty_like(q)
        paged_attention(q, m["k_cache"], m["v_cache"], attn, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                        D**-0.5, 1, meta.max_seq_len, 1, num_segments=4)  # fmt: skip
        o = linear(attn.reshape(1, HQ * D), lw["o"])
        h, res = fused_add_rms_norm(o, res, lw["post"], 1e-6)
        weights, ids = softmax_topk(linear(h, lw["router"]).float(), TOPK)
        y = fused_experts(h, weights, ids, lw["w13"], lw["w2"])
        h, res = fused_add_rms_norm(y, res, lw["norm"], 1e-6)
        # a dense MLP's activation between two GEMVs (Llama's layer)
        h = linear(silu_and_mul(linear(h, lw["gate_up"])), lw["down"])
        # an FP8 linear at one row on the tensor-core GEMV (the gate_up of FP8 Llama on Hopper)
        hq, hs = fp8_quant.quant_dynamic(h, H)
        h = fp8_gemv(hq, hs, lw["fp8"], lw["fp8_scale"], None, BF16, kernel="dot", block_n=32, block_k=256)
    return h


def run(m, inputs, enabled):
    """The chain's outputs for each input, through one graph captured with PDL on or off."""
    pdl.configure(enabled)
    try:
        x_buf = inputs[0].clone()
        positions = torch.tensor([300], device=DEV)
        slots = m["meta"].slot_mapping[:1]
        k0, v0 = m["k_cache"].clone(), m["v_cache"].clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step(m, x_buf, positions, slots)  # compile and warm up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(m, x_buf, positions, slots)
        results = []
        for x in inputs:
            m["k_cache"].copy_(k0), m["v_cache"].copy_(v0)
            x_buf.copy_(x)
            graph.replay()
            results.append(out.clone())
        torch.cuda.synchronize()
        return results
    finally:
        pdl.configure(True)


def test_pdl_chain_in_a_cuda_graph_matches_pdl_off(model):
    g = torch.Generator(DEV).manual_seed(1)
    inputs = [torch.randn(1, H, generator=g, device=DEV).to(BF16) for _ in range(6)]
    assert pdl.active(inputs[0])
    on, off = run(model, inputs, True), run(model, inputs, False)
    for a, b in zip(on, off, strict=True):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert not torch.equal(on[0], on[1])  # the inputs reach the output: a stale read would show
