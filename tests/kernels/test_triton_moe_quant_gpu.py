"""The Triton fused MoE with quantised experts on CUDA in bf16 against atomc::moe_quant's reference
(dequantise, per-expert loop): MXFP4 at GPT-OSS-20B's widths (H 2880, I 2880, 32 experts, top-4,
biases, the clamped SwiGLU) on every route at its default tiles, an expert map, determinism,
CUDA-graph capture; FP8 weight-only (per-row and 128x128 block scales) at Qwen3-30B-A3B's widths."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

from triton_kernel_cases import make_moe, rel_err  # noqa: E402

from atomc.ops.moe import experts_reference, select_experts  # noqa: E402
from atomc.ops.moe_quant import dequantize_mxfp4  # noqa: E402
from models.quant.mxfp4 import quantize_mxfp4  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
REL = 2e-2  # bf16 activations rounded where the reference rounds them; different sum orders
E, H, INTER, K = 32, 2880, 2880, 4


@pytest.fixture(scope="module")
def experts():
    _, _, w13, w2, b13, b2 = make_moe(1, E, H, INTER, K, BF16, DEV, bias=True, seed=1)
    (q13, s13), (q2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    yield dict(q13=q13, s13=s13, q2=q2, s2=s2, b13=b13, b2=b2,
               d13=dequantize_mxfp4(q13, s13, BF16), d2=dequantize_mxfp4(q2, s2, BF16))  # fmt: skip
    torch.cuda.empty_cache()


def run(s, t, seed=0, expert_map=None, config=None, scale=1.0):
    from atomc.kernels.triton.moe_quant import fused_experts_mxfp4

    g = torch.Generator(DEV).manual_seed(seed)
    x = (torch.randn(t, H, generator=g, device=DEV) * scale).to(BF16)
    weights, ids = select_experts(torch.randn(t, E, generator=g, device=DEV), K)
    n = E if expert_map is None else int(expert_map.max()) + 1
    args = (s["b13"][:n], s["b2"][:n], expert_map, "swiglu_oai", 1.702, 7.0)
    out = fused_experts_mxfp4(x, weights, ids, s["q13"][:n], s["s13"][:n], s["q2"][:n], s["s2"][:n], *args,
                              config=config)  # fmt: skip
    ref = experts_reference(x, weights, ids, s["d13"][:n], s["d2"][:n], *args)
    return out, ref


@pytest.mark.parametrize("t", [1, 4, 16, 200, 1024])  # gemv, small, small, sorted, sorted
def test_routes_match_reference(experts, t):
    out, ref = run(experts, t, seed=t)
    assert not out.isnan().any() and rel_err(out, ref) < REL, rel_err(out, ref)


# the one-token route on mxfp4_packed.py's f16-pair step (its PTX FMAs): the default tiles plus the knob
GEMV_TILE = dict(block_m=0, block_n=4, block_k=1024, num_warps=4, num_stages=4)
PACKED = {"path": "gemv", "gate_up": dict(GEMV_TILE, packed_f16=True), "down": dict(GEMV_TILE, packed_f16=True)}
FP32_STEP = {"path": "gemv", "gate_up": dict(GEMV_TILE), "down": dict(GEMV_TILE)}


@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
def test_packed_gemv_matches_reference_and_the_fp32_step(experts, scale):
    """x at three magnitudes (x_shift moves each into f16's range): the reference within REL, and
    the fp32 step's output within 5e-3 (the f16 sums of a scale group, 2^-11 a step, then bf16)."""
    out, ref = run(experts, 1, seed=5, config=PACKED, scale=scale)
    fp32_step, _ = run(experts, 1, seed=5, config=FP32_STEP, scale=scale)
    assert not out.isnan().any() and rel_err(out, ref) < REL, rel_err(out, ref)
    assert rel_err(out, fp32_step) < 5e-3, rel_err(out, fp32_step)


@pytest.mark.parametrize("config", [FP32_STEP, PACKED], ids=["fp32", "packed_f16"])
@pytest.mark.parametrize("t", [2, 8, 16])
def test_few_token_gemv_matches_reference(experts, t, config):
    """The MXFP4 gemv route past one token (moe_config.GEMV_MAX_TOKENS) at GPT-OSS-20B's widths."""
    out, ref = run(experts, t, seed=t, config=config)
    assert not out.isnan().any() and rel_err(out, ref) < REL, rel_err(out, ref)


@pytest.mark.parametrize("t", [1, 200])
def test_expert_map(experts, t):
    expert_map = torch.full((E,), -1, dtype=torch.int32, device=DEV)
    expert_map[:16] = torch.arange(16, dtype=torch.int32, device=DEV)
    out, ref = run(experts, t, seed=3, expert_map=expert_map)
    assert rel_err(out, ref) < REL


def test_deterministic_and_graph_capturable(experts):
    from atomc.kernels.triton.moe_quant import fused_experts_mxfp4

    for t in (1, 200):
        g = torch.Generator(DEV).manual_seed(t)
        x = torch.randn(t, H, generator=g, device=DEV).to(BF16)
        weights, ids = select_experts(torch.randn(t, E, generator=g, device=DEV), K)
        s = experts

        def call(x=x, weights=weights, ids=ids, s=s):
            return fused_experts_mxfp4(x, weights, ids, s["q13"], s["s13"], s["q2"], s["s2"], s["b13"], s["b2"],
                                       None, "swiglu_oai", 1.702, 7.0)  # fmt: skip

        first = call()
        assert torch.equal(first, call())
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = call()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, first)


FP8_GEMV_TILE = dict(block_m=0, block_n=2, block_k=1024, num_warps=4, num_stages=4)


def quantize_fp8(w: torch.Tensor, block: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 experts with per-row or 128x128-block scales (amax / 448); dims multiples of 128."""
    if not block:
        s = w.abs().amax(-1) / 448
        return (w / s[..., None]).to(torch.float8_e4m3fn), s
    s = w.unflatten(1, (-1, 128)).unflatten(3, (-1, 128)).abs().amax((2, 4)) / 448
    full = s.repeat_interleave(128, 1).repeat_interleave(128, 2)
    return (w / full).to(torch.float8_e4m3fn), s


@pytest.mark.parametrize("fmt", ["fp8_channel", "fp8_block"])
@pytest.mark.parametrize("packed", [False, True], ids=["dequantising", "packed_f16"])
@pytest.mark.parametrize("scale", [1e-2, 1.0, 100.0])
def test_fp8_gemv_loops_at_qwen3_moe_widths(fmt, packed, scale):
    """One token's FP8 experts, per-row or block scales, on the dequantising loop and on moe_gemv.py's
    packed-f16 loop (block scales folded into x; x at three magnitudes: the shift moves each into
    f16's range), against the reference."""
    from atomc.kernels.triton.moe_quant import fused_experts_quant
    from atomc.ops.moe_quant import dequantize_fp8_experts

    e, h, inter, k = 128, 2048, 768, 8
    block = fmt == "fp8_block"
    _, _, w13, w2, _, _ = make_moe(1, e, h, inter, k, torch.float32, DEV, seed=4)
    (q13, s13), (q2, s2) = quantize_fp8(w13, block), quantize_fp8(w2, block)
    g = torch.Generator(DEV).manual_seed(9)
    x = (torch.randn(1, h, generator=g, device=DEV) * scale).to(BF16)
    weights, ids = select_experts(torch.randn(1, e, generator=g, device=DEV), k)
    tile = dict(FP8_GEMV_TILE, packed_f16=packed)
    config = {"path": "gemv", "gate_up": tile, "down": dict(tile)}
    out = fused_experts_quant(x, weights, ids, q13, s13, q2, s2, weight_format=fmt, config=config)
    d13, d2 = dequantize_fp8_experts(q13, s13, block, BF16), dequantize_fp8_experts(q2, s2, block, BF16)
    ref = experts_reference(x, weights, ids, d13, d2, None, None, None, "silu", 1.702, 7.0)
    assert not out.isnan().any() and rel_err(out, ref) < REL, rel_err(out, ref)


@pytest.mark.parametrize("fmt", ["fp8_channel", "fp8_block"])
@pytest.mark.parametrize("t", [1, 16, 512])
def test_fp8_experts_at_qwen3_moe_widths(fmt, t):
    """FP8 weight-only experts (E 128, H 2048, I 768, top-8; no bias, SiLU) on every route."""
    from atomc.kernels.triton.moe_quant import fused_experts_quant
    from atomc.ops.moe_quant import dequantize_fp8_experts

    e, h, inter, k = 128, 2048, 768, 8
    _, _, w13, w2, _, _ = make_moe(1, e, h, inter, k, torch.float32, DEV, seed=2)
    block = fmt == "fp8_block"
    (q13, s13), (q2, s2) = quantize_fp8(w13, block), quantize_fp8(w2, block)
    g = torch.Generator(DEV).manual_seed(t)
    x = torch.randn(t, h, generator=g, device=DEV).to(BF16)
    weights, ids = select_experts(torch.randn(t, e, generator=g, device=DEV), k)
    out = fused_experts_quant(x, weights, ids, q13, s13, q2, s2, weight_format=fmt)
    d13, d2 = dequantize_fp8_experts(q13, s13, block, BF16), dequantize_fp8_experts(q2, s2, block, BF16)
    ref = experts_reference(x, weights, ids, d13, d2, None, None, None, "silu", 1.702, 7.0)
    assert rel_err(out, ref) < REL, rel_err(out, ref)
