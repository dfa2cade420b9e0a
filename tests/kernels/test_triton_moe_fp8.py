"""The Triton fused MoE with FP8 experts (weight-only: atomc/kernels/triton/moe_quant.py on
moe_gemm.py's and moe_gemv.py's kernels, the format a constexpr) against atomc::moe_quant's
reference (dequantise, then the per-expert loop)
on CPU through the Triton interpreter, fp32 and fp16: per-row ("fp8_channel") and 128x128-block
("fp8_block") scales, every route, both activations with biases, an expert map. H = 200 and
I = 136 are not multiples of 128, so partial scale blocks and every tile edge are masked; the
blocks' scales differ widely, so a scale read from the wrong block shows."""

import importlib

import pytest
import torch
from triton_interpreter import use_interpreter

use_interpreter()  # before the first triton import

triton = pytest.importorskip("triton")
from triton_kernel_cases import make_moe, rel_err  # noqa: E402

from atomc.kernels.triton import arrivals, moe_quant  # noqa: E402
from atomc.kernels.triton.moe_quant import fused_experts_quant  # noqa: E402
from atomc.ops.moe import apply_activation, experts_reference, select_experts  # noqa: E402
from atomc.ops.moe_quant import dequantize_fp8_experts  # noqa: E402

E, H, INTER, K = 4, 200, 136, 2
FP8 = torch.float8_e4m3fn
TOL = {torch.float32: 1e-5, torch.float16: 3e-3}
TILE = dict(block_m=16, block_n=16, block_k=64, num_warps=4, num_stages=2)
SMALL = {"path": "small", "gate_up": dict(TILE), "down": dict(TILE)}
SORTED = {"path": "sorted", "gate_up": dict(TILE), "down": dict(TILE, block_k=256)}  # steps over 2 blocks
GEMV = {"path": "gemv", "gate_up": dict(TILE, block_n=4, block_k=64), "down": dict(TILE, block_n=2, block_k=32)}
# moe_gemv.py's packed-f16 loop (per-row scales): no rounding of each dequantised weight to x's dtype
# (the reference's, 2^-11 relative in fp16), x in f16 (exact for fp16 x, 2^-11 for fp32), products
# and the few partial sums a column adds in f16 (2^-11 each), the activation between the GEMVs on
# top: 4e-4 to 2.3e-3 measured over the cases below (bf16's own rounding, the engine's, is 2^-9)
PACKED = {**GEMV, "gate_up": dict(GEMV["gate_up"], packed_f16=True), "down": dict(GEMV["down"], packed_f16=True)}
PACKED_TOL = 5e-3
# block scales folded into x: x * scale has f16's 11 significant bits where bf16 / fp16 x had 8 /
# 11, so each product w * x' rounds too (2^-11); measured 1e-3 to 7.8e-3 over the cases below
# (x at 20 through the clamped SwiGLU the largest), the dequantising loop 2e-4 to 7e-4
BLOCK_PACKED_TOL = 1e-2


def quantize(w: torch.Tensor, block: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 weights and per-row or per-128x128-block scales (amax / 448), rows of blocks scaled apart
    by up to 2^6 so each block's scale matters."""
    e, n, k = w.shape
    w = w * torch.logspace(0, 6, n, base=2.0)[None, :, None]
    if not block:
        s = w.abs().amax(-1) / 448
        return (w / s[..., None]).to(FP8), s
    nb, kb = -(-n // 128), -(-k // 128)
    padded = torch.zeros(e, nb * 128, kb * 128)
    padded[:, :n, :k] = w
    s = padded.unflatten(1, (nb, 128)).unflatten(3, (kb, 128)).abs().amax((2, 4)).clamp(min=1e-8) / 448
    full = s.repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)[:, :, :k]
    return (w / full).to(FP8), s


def check(t, dtype, config, fmt, *, activation="silu", bias=False, expert_map=None, seed=0, tol=None, scale=0.05,
          h=H, inter=INTER):  # fmt: skip
    block = fmt == "fp8_block"
    x, logits, w13, w2, b13, b2 = make_moe(t, E, h, inter, K, torch.float32, "cpu", bias=bias, seed=seed)
    x = (x * scale).to(dtype)  # the weights' rows grow up to 64x: keep activations O(1)
    b13, b2 = (None, None) if not bias else (b13.to(dtype), b2.to(dtype))
    (q13, s13), (q2, s2) = quantize(w13, block), quantize(w2, block)
    weights, ids = select_experts(logits, K)
    if expert_map is not None:
        n = int(expert_map.max()) + 1
        q13, s13, q2, s2 = q13[:n], s13[:n], q2[:n], s2[:n]
        b13, b2 = (None, None) if not bias else (b13[:n], b2[:n])
    out = fused_experts_quant(x, weights, ids, q13, s13, q2, s2, b13, b2, expert_map, activation, 1.702, 7.0,
                              fmt, config=config)  # fmt: skip
    d13, d2 = dequantize_fp8_experts(q13, s13, block, dtype), dequantize_fp8_experts(q2, s2, block, dtype)
    ref = experts_reference(x, weights, ids, d13, d2, b13, b2, expert_map, activation, 1.702, 7.0)
    assert out.shape == x.shape and not out.isnan().any() and ref.abs().max() > 0
    assert rel_err(out, ref) < (tol or TOL[dtype]), rel_err(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scale", [1e-4, 0.05, 20.0])
def test_packed_gemv_matches_reference(dtype, scale):
    """x at 1e-4, 0.05 and 20 (the down GEMV's input is the activation of those): x_shift moves each
    into f16's range; per-row scales (block scales: the test below)."""
    check(1, dtype, PACKED, "fp8_channel", activation="swiglu_oai", seed=7, tol=PACKED_TOL, scale=scale)


def test_block_scales_on_gemv_steps_wider_than_a_block():
    """The one-token defaults step 1,024-2,048 columns: a [rows, columns / 128] scale load times the
    [rows, columns / 128, 128] view of the tile, stepping over 400 / 300 columns (the last step ends
    inside a block, masked)."""
    wide = {"path": "gemv", "gate_up": dict(TILE, block_n=2, block_k=256), "down": dict(TILE, block_n=2, block_k=256)}
    check(1, torch.float32, wide, "fp8_block", activation="swiglu_oai", bias=True, seed=9, h=400, inter=300)
    check(1, torch.float16, wide, "fp8_block", seed=10, h=400, inter=300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scale", [1e-4, 20.0])
@pytest.mark.parametrize("block_k", [64, 256], ids=["step_in_a_block", "step_over_blocks"])
def test_packed_gemv_with_block_scales_matches_reference(dtype, scale, block_k):
    """Block scales folded into x (each program's rows in one 128-row block): gate rows in blocks
    0-1 and up rows in 2-3 (I = 256), a shift over x times both blocks' scales, K = 400 ending
    inside a block; steps of 64 (one scale a step) and 256 columns (two a step)."""
    packed = {"path": "gemv", "gate_up": dict(TILE, block_n=4, block_k=block_k, packed_f16=True),
              "down": dict(TILE, block_n=2, block_k=block_k, packed_f16=True)}  # fmt: skip
    check(1, dtype, packed, "fp8_block", activation="swiglu_oai", bias=True, seed=11, tol=BLOCK_PACKED_TOL,
          scale=scale, h=400, inter=256)  # fmt: skip


def test_packed_block_scales_need_whole_row_blocks():
    """I = 136: the up rows do not start a block, so gate/up keeps the dequantising loop (the
    knob is dropped); the down GEMV's programs (2 rows) each lie in one block and run packed."""
    tile = dict(TILE, block_n=4, block_k=64, packed_f16=True)
    assert "packed" not in moe_quant._packed_fp8_knob(tile, H, block_rows=False)
    assert moe_quant._packed_fp8_knob(tile, H)["packed"]["PACKED"]
    check(1, torch.float32, PACKED, "fp8_block", activation="swiglu_oai", bias=True, seed=8, tol=BLOCK_PACKED_TOL)


@pytest.mark.parametrize("fmt", ["fp8_channel", "fp8_block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config,t", [(GEMV, 1), (SMALL, 5), (SORTED, 37)], ids=["gemv", "small", "sorted"])
def test_routes_match_reference(fmt, dtype, config, t):
    check(t, dtype, config, fmt, activation="swiglu_oai", bias=True, seed=t)


@pytest.mark.parametrize("fmt", ["fp8_channel", "fp8_block"])
def test_small_route_combines_in_the_down_kernel_at_one_token(fmt, monkeypatch):
    # COMBINE_IN_DOWN_ONE_TOKEN: the FP8 experts' down kernel sums the two expert rows of each of
    # its 16-column tiles (H 200: the last tile masked); no combine kernel; counters left at zero
    moe = importlib.import_module("atomc.kernels.triton.moe")
    monkeypatch.setattr(moe, "COMBINE_IN_DOWN_ONE_TOKEN", True)
    monkeypatch.setattr(moe_quant, "moe_combine_kernel", None)  # launching it would fail
    check(1, torch.float16, SMALL, fmt, activation="swiglu_oai", bias=True, seed=12)
    check(1, torch.float32, SMALL, fmt, seed=13)
    assert not arrivals.counters(torch.device("cpu"), "moe_down_combine").any()


@pytest.mark.parametrize("fmt", ["fp8_channel", "fp8_block"])
def test_silu_without_bias_and_an_expert_map(fmt):
    expert_map = torch.tensor([0, 1, -1, -1], dtype=torch.int32)
    check(1, torch.float32, GEMV, fmt, expert_map=expert_map, seed=3)
    check(24, torch.float32, SORTED, fmt, expert_map=expert_map, seed=4)


def test_scales_of_the_wrong_shape_are_refused():
    x, logits, w13, w2, _, _ = make_moe(1, E, H, INTER, K, torch.float32, "cpu")
    (q13, s13), (q2, s2) = quantize(w13, False), quantize(w2, False)
    weights, ids = select_experts(logits, K)
    with pytest.raises(ValueError, match="are not fp8_block experts of this width"):
        fused_experts_quant(x, weights, ids, q13, s13, q2, s2, weight_format="fp8_block")


def fp8_activations(a: torch.Tensor, block: bool) -> torch.Tensor:
    """a's dynamic e4m3 quantisation (per row, or per 128-value group of a row), dequantised in fp32."""
    a = a.float()
    k = a.shape[-1]
    g = torch.nn.functional.pad(a, (0, -k % 128)).unflatten(-1, (-1, 128)) if block else a[..., None, :]
    amax = g.abs().amax(-1, keepdim=True)
    s = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    return ((g / s).clamp(-448, 448).to(FP8).float() * s).flatten(-2)[..., :k]


def w8a8_reference(x, weights, ids, q13, s13, q2, s2, b13, b2, block, activation):
    """The experts with e4m3 activations: each GEMM's input quantised dynamically, products and sums
    in fp32, rounded to x's dtype where the kernels round (gate/up, the activation, down)."""
    dtype = x.dtype
    d13 = dequantize_fp8_experts(q13, s13, block, torch.float32)
    d2 = dequantize_fp8_experts(q2, s2, block, torch.float32)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in torch.unique(ids).tolist():
        token, slot = torch.nonzero(ids == e, as_tuple=True)
        h = fp8_activations(x[token], block) @ d13[e].T + (0 if b13 is None else b13[e].float())
        a = apply_activation(h.to(dtype).float(), activation, 1.702, 7.0).to(dtype)
        y = fp8_activations(a, block) @ d2[e].T + (0 if b2 is None else b2[e].float())
        out.index_add_(0, token, y.to(dtype).float() * weights[token, slot, None])
    return out.to(dtype)


# the same arithmetic in another order: fp32 sums of exact e4m3 products, the scales applied after
# (the reference scales every product); an activation rounded one ulp apart moves its e4m3 code in
# the down GEMM's input now and then. Measured below 1e-5 (fp32) / 2e-3 (fp16).
A8_TOL = {torch.float32: 1e-4, torch.float16: 3e-3}


@pytest.mark.parametrize("fmt", ["fp8_channel", "fp8_block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,path", [(1, "small"), (5, "small"), (37, "sorted")])
def test_a8_tiles_match_the_w8a8_reference(fmt, dtype, t, path):
    """`a8` tiles: x and the activation quantised to e4m3 in the kernels (per token for per-row
    weights, per 128-value group for blocks: H = 400 ends inside a group), raw e4m3 weights into
    the dot; against the fp32 W8A8 reference, both activations, biases."""
    block = fmt == "fp8_block"
    tile = dict(TILE, block_k=128, a8=True)
    config = {"path": path, "gate_up": tile, "down": dict(tile, block_n=32)}
    x, logits, w13, w2, b13, b2 = make_moe(t, E, 400, 256, K, torch.float32, "cpu", bias=True, seed=20 + t)
    x, b13, b2 = (x * 0.5).to(dtype), b13.to(dtype), b2.to(dtype)
    (q13, s13), (q2, s2) = quantize(w13, block), quantize(w2, block)
    weights, ids = select_experts(logits, K)
    for activation in ("silu", "swiglu_oai"):
        out = fused_experts_quant(x, weights, ids, q13, s13, q2, s2, b13, b2, None, activation, 1.702, 7.0, fmt,
                                  config=config)  # fmt: skip
        ref = w8a8_reference(x, weights, ids, q13, s13, q2, s2, b13, b2, block, activation)
        assert not out.isnan().any() and ref.abs().max() > 0
        assert rel_err(out, ref) < A8_TOL[dtype], (activation, rel_err(out, ref))


def test_a8_tiles_are_checked():
    x = torch.zeros(1, H)
    for fmt, block_k in (("fp8_block", 64), ("fp8_channel", 16)):
        config = {"path": "small", "gate_up": dict(TILE, block_k=block_k, a8=True), "down": dict(TILE, a8=True)}
        block = fmt == "fp8_block"
        (q13, s13), (q2, s2) = quantize(torch.randn(E, 2 * INTER, H), block), quantize(torch.randn(E, H, INTER), block)
        with pytest.raises(ValueError, match="a8 tile steps"):
            fused_experts_quant(x, torch.ones(1, K), torch.zeros(1, K, dtype=torch.int32), q13, s13, q2, s2,
                                weight_format=fmt, config=config)  # fmt: skip
