"""The one-row GEMV + residual add + RMSNorm (+ FP8 quant) of gemv_norm.py on CUDA, at the decoder
widths it serves (bf16 and e4m3), with PDL as the engine launches it: against the two kernels it
replaces, eager, repeated (the counter resets) and replayed in a CUDA graph with new inputs."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16 = torch.bfloat16
SHAPES = {"llama_o": (4096, 4096), "llama_down": (4096, 14336), "qwen3_moe_o": (2048, 4096), "v2_lite_o": (2048, 2048)}


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def inputs(n, k, g):
    x = torch.randn(1, k, generator=g, device="cuda").to(BF16)
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(BF16)
    res = torch.randn(1, n, generator=g, device="cuda").to(BF16)
    nw = (1 + 0.3 * torch.randn(n, generator=g, device="cuda")).to(BF16)
    return x, w, res, nw


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_bf16_row_against_the_two_kernels_eager_and_in_a_graph(shape):
    from atomc.kernels.triton import gemv_norm
    from atomc.kernels.triton.gemv import linear
    from atomc.kernels.triton.rmsnorm import fused_add_rms_norm

    n, k = shape
    g = torch.Generator("cuda").manual_seed(0)
    x, w, res, nw = inputs(n, k, g)
    for _ in range(3):
        normed, summed = gemv_norm.linear_add_rms_norm(x, w, None, res, nw, 1e-6)
        want_normed, want_summed = fused_add_rms_norm(linear(x, w), res, nw, 1e-6)
        assert rel(summed, want_summed) < 1e-3 and rel(normed, want_normed) < 1e-3
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, summed = gemv_norm.linear_add_rms_norm(x, w, None, res, nw, 1e-6)
    for _ in range(2):
        x.copy_(torch.randn(x.shape, generator=g, device="cuda"))
        graph.replay()
        want_normed, want_summed = fused_add_rms_norm(linear(x, w), res, nw, 1e-6)
        assert rel(summed, want_summed) < 1e-3 and rel(normed, want_normed) < 1e-3


@pytest.mark.parametrize("shape", [SHAPES["llama_o"], SHAPES["llama_down"]], ids=["llama_o", "llama_down"])
def test_fp8_row_against_the_two_kernels(shape):
    from atomc.kernels.triton import fp8_quant, gemv_norm
    from atomc.kernels.triton.fp8_gemv import fp8_gemv

    n, k = shape
    g = torch.Generator("cuda").manual_seed(1)
    w = (torch.randn(n, k, generator=g, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    xq = (torch.randn(1, k, generator=g, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    xs = torch.full((1, 1), 0.01, device="cuda")
    ws = torch.rand(n, generator=g, device="cuda") / (200 * k**0.5)
    _, _, res, nw = inputs(n, 16, g)
    for _ in range(3):
        got = gemv_norm.fp8_gemv_add_rms_norm_quant(xq, xs, w, ws, None, BF16, res, nw, 1e-6, n)
        assert got is not None
        q, s, summed = got
        y = fp8_gemv(xq, xs, w, ws, None, BF16)
        want_q, want_s, want_summed = fp8_quant.rms_norm_quant(y, res, nw, 1e-6, None, n)
        assert rel(summed, want_summed) < 1e-3 and rel(s, want_s) < 1e-3
        flips = (q.float() != want_q.float()).sum().item()
        assert flips <= 8, f"{flips} e4m3 values differ"
