"""The Triton fused MoE with MXFP4 experts (atomc/kernels/triton/moe_quant.py: moe_mxfp4_gemv.py, moe_gemm.py)
against atomc::moe_quant's reference (dequantise, then the per-expert loop) on CPU through the
Triton interpreter, in fp32 and fp16 (the interpreter mishandles bf16): the one-token GEMV route,
the few-pair and the sorted routes, both activations, biases, an expert map. H = 96 and I = 64
with byte steps that do not divide them, so the byte and scale-group masks are exercised."""

import pytest
import torch
from triton_interpreter import use_interpreter

use_interpreter()  # before the first triton import; the GPU file covers CUDA

triton = pytest.importorskip("triton")
from triton_kernel_cases import make_moe, rel_err  # noqa: E402

from atomc.kernels.triton.moe_quant import fused_experts_mxfp4, fused_moe_quant  # noqa: E402
from atomc.ops.moe import experts_reference, select_experts  # noqa: E402
from atomc.ops.moe_quant import dequantize_mxfp4  # noqa: E402
from models.quant.mxfp4 import quantize_mxfp4  # noqa: E402

E, H, INTER, K = 6, 96, 64, 2
TOL = {torch.float32: 1e-5, torch.float16: 3e-3}
TILE = dict(block_m=16, block_n=16, block_k=64, num_warps=4, num_stages=2)
SMALL = {"path": "small", "gate_up": dict(TILE), "down": dict(TILE)}
SORTED = {"path": "sorted", "gate_up": dict(TILE), "down": dict(TILE)}
GEMV = {"path": "gemv", "gate_up": dict(TILE, block_n=4, block_k=64), "down": dict(TILE, block_n=2, block_k=32)}
# the packed-f16 step (mxfp4_packed.py): fp32 x rounds to f16 (2^-11; bf16 x, as in the engine,
# would not) and each scale group's 32 products sum in f16 (2^-11 a step): 1e-3 measured
PACKED = {**GEMV, "gate_up": dict(GEMV["gate_up"], packed_f16=True), "down": dict(GEMV["down"], packed_f16=True)}
PACKED_TOL = 3e-3


def mxfp4_moe(t, dtype, *, bias=False, k=K, seed=0):
    x, logits, w13, w2, b13, b2 = make_moe(t, E, H, INTER, k, dtype, "cpu", bias=bias, seed=seed)
    q13, q2 = quantize_mxfp4(w13), quantize_mxfp4(w2)
    return x, logits, q13, q2, b13, b2


def check(t, dtype, config, *, activation="silu", bias=False, expert_map=None, k=K, seed=0, tol=None):
    x, logits, (w13, s13), (w2, s2), b13, b2 = mxfp4_moe(t, dtype, bias=bias, k=k, seed=seed)
    weights, ids = select_experts(logits, k)
    if expert_map is not None:  # this rank holds only the mapped experts' rows
        n = int(expert_map.max()) + 1
        w13, s13, w2, s2 = w13[:n], s13[:n], w2[:n], s2[:n]
        b13, b2 = (None, None) if not bias else (b13[:n], b2[:n])
    out = fused_experts_mxfp4(x, weights, ids, w13, s13, w2, s2, b13, b2, expert_map, activation, 1.702, 7.0,
                              config=config)  # fmt: skip
    dense13, dense2 = dequantize_mxfp4(w13, s13, dtype), dequantize_mxfp4(w2, s2, dtype)
    ref = experts_reference(x, weights, ids, dense13, dense2, b13, b2, expert_map, activation, 1.702, 7.0)
    assert out.shape == x.shape and out.dtype == dtype and not out.isnan().any()
    assert rel_err(out, ref) < (tol or TOL[dtype]), rel_err(out, ref)
    return out, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation,bias", [("silu", False), ("swiglu_oai", True)])
@pytest.mark.parametrize("k", [1, 4])
def test_gemv_route_matches_reference(k, dtype, activation, bias):
    check(1, dtype, GEMV, activation=activation, bias=bias, k=k, seed=k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation,bias", [("silu", False), ("swiglu_oai", True)])
@pytest.mark.parametrize("k", [1, 4])
def test_packed_gemv_route_matches_reference(k, dtype, activation, bias):
    check(1, dtype, PACKED, activation=activation, bias=bias, k=k, seed=k, tol=PACKED_TOL)


@pytest.mark.parametrize("config", [GEMV, PACKED], ids=["fp32", "packed_f16"])
def test_gemv_route_takes_a_few_tokens(config):
    """Up to GEMV_MAX_TOKENS tokens on the GEMVs (a pair a program, a token's slots summed in its
    down program): against the reference, and each token's row as the one-token call gives it.
    (Three tokens: the interpreter runs a program in ~50 ms.)"""
    t, tol = 3, PACKED_TOL if config is PACKED else None
    out, _ = check(t, torch.float32, config, activation="swiglu_oai", bias=True, seed=t, tol=tol)
    x, logits, (w13, s13), (w2, s2), b13, b2 = mxfp4_moe(t, torch.float32, bias=True, seed=t)
    weights, ids = select_experts(logits, K)
    for i in (0, t - 1):
        one = fused_experts_mxfp4(x[i : i + 1], weights[i : i + 1], ids[i : i + 1], w13, s13, w2, s2, b13, b2, None,
                                  "swiglu_oai", 1.702, 7.0, config=config)  # fmt: skip
        torch.testing.assert_close(out[i : i + 1], one, rtol=1e-6, atol=1e-7)


def test_gemv_route_refuses_more_tokens_than_it_takes():
    x, logits, (w13, s13), (w2, s2), _, _ = mxfp4_moe(17, torch.float32)
    weights, ids = select_experts(logits, K)
    with pytest.raises(ValueError, match="gemv route takes 16 token"):
        fused_experts_mxfp4(x, weights, ids, w13, s13, w2, s2, config=GEMV)


def test_packed_gemv_falls_back_on_weights_not_4_byte_aligned():
    """Expert bytes that start 2 bytes into a buffer cannot be read as int32 words: the fp32 step
    runs (its fp32 tolerance, which the packed step's f16 sums would not meet)."""
    x, logits, (w13, s13), (w2, s2), _, _ = mxfp4_moe(1, torch.float32)
    weights, ids = select_experts(logits, K)

    def shifted(w):
        s = torch.empty(w.numel() + 2, dtype=torch.uint8)[2:].view(w.shape)
        s.copy_(w)
        assert s.data_ptr() % 4 == 2 and s.is_contiguous()
        return s

    out = fused_experts_mxfp4(x, weights, ids, shifted(w13), s13, shifted(w2), s2, config=PACKED)
    d13, d2 = dequantize_mxfp4(w13, s13, torch.float32), dequantize_mxfp4(w2, s2, torch.float32)
    ref = experts_reference(x, weights, ids, d13, d2, None, None, None, "silu", 1.702, 7.0)
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation,bias", [("silu", False), ("swiglu_oai", True)])
def test_small_route_matches_reference(dtype, activation, bias):
    check(5, dtype, SMALL, activation=activation, bias=bias, seed=5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("activation,bias", [("silu", False), ("swiglu_oai", True)])
def test_sorted_route_matches_reference(dtype, activation, bias):
    check(37, dtype, SORTED, activation=activation, bias=bias, seed=37)


@pytest.mark.parametrize("config", [GEMV, SORTED], ids=["gemv", "sorted"])
def test_expert_map_skips_other_ranks_experts(config):
    """Experts 3.. live on another rank: their pairs add nothing (the reference agrees)."""
    expert_map = torch.tensor([0, 1, 2, -1, -1, -1], dtype=torch.int32)
    t = 3 if config is GEMV else 24
    out, _ = check(t, torch.float32, config, expert_map=expert_map, bias=True, activation="swiglu_oai", seed=2)
    assert out.abs().sum() > 0


def test_default_configs_and_the_op_entry_point():
    """No config given: the default tiles of each token count (GEMV at 1, small, sorted) through
    fused_moe_quant (routing included), against atomc::moe_quant's reference body."""
    for t in (1, 3, 40):
        x, logits, (w13, s13), (w2, s2), b13, b2 = mxfp4_moe(t, torch.float32, bias=True, seed=t)
        args = (x, logits, w13, s13, w2, s2, b13, b2, None, None, K, "mxfp4", "softmax", True, 0, 0, 1.0,
                "swiglu_oai", 1.702, 7.0)  # fmt: skip
        out = fused_moe_quant(*args)
        ref = torch.ops.atomc.moe_quant(*args)
        assert rel_err(out, ref) < 1e-5, (t, rel_err(out, ref))


def test_bad_tiles_and_formats_are_refused():
    x, logits, (w13, s13), (w2, s2), _, _ = mxfp4_moe(1, torch.float32)
    weights, ids = select_experts(logits, K)
    bad = {**GEMV, "gate_up": dict(GEMV["gate_up"], block_k=48)}
    with pytest.raises(ValueError, match="block_k \\(48\\) must be a multiple of 32"):
        fused_experts_mxfp4(x, weights, ids, w13, s13, w2, s2, config=bad)
    with pytest.raises(ValueError, match="are not mxfp4 experts of this width"):
        fused_experts_mxfp4(x[:, :64], weights, ids, w13, s13, w2, s2)
    with pytest.raises(ValueError, match="'int4' has no Triton kernel"):
        fused_moe_quant(x, logits, w13, s13, w2, s2, None, None, None, None, K, "int4")
