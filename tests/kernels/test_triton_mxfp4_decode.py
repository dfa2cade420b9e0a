"""The MXFP4 decode of the MoE kernels (atomc/kernels/triton/moe_tiles.py) on CPU through the Triton
interpreter: every e2m1 code under every e8m0 scale against atomc::moe_quant's dequantiser
(both exact, so equal: e2m1 times a power of two needs 2 significant bits), the decoded fp32
values exact in bf16 (the tensor-core route rounds them to bf16 losslessly), and a tile of
`mxfp4_tile` in input order with its scale groups, including a tile past the row's end."""

import os
import sys

import pytest
import torch

if torch.cuda.is_available():  # the interpreter setting is process-wide
    pytest.skip("interpreter tests run on machines without CUDA", allow_module_level=True)
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET=1; run this file alone", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from atomc.kernels.triton.moe_tiles import e2m1_pair, e8m0_scale, mxfp4_tile  # noqa: E402
from atomc.ops.moe_quant import dequantize_mxfp4  # noqa: E402
from models.quant.mxfp4 import quantize_mxfp4  # noqa: E402


@triton.jit
def _decode_kernel(b_ptr, s_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    lo, hi = e2m1_pair(tl.load(b_ptr + offs, mask=ok), e8m0_scale(tl.load(s_ptr + offs, mask=ok)))
    tl.store(out_ptr + 2 * offs, lo, mask=ok)
    tl.store(out_ptr + 2 * offs + 1, hi, mask=ok)


@triton.jit
def _tile_kernel(w_ptr, s_ptr, out_ptr, k0, K, stride_wn, stride_sn, ROWS, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):  # fmt: skip
    offs_n = tl.arange(0, BLOCK_N)
    n_ok = offs_n < ROWS
    rows = offs_n.to(tl.int64)[:, None]
    tile = mxfp4_tile(w_ptr + rows * stride_wn, s_ptr + rows * stride_sn, n_ok, k0, K, BLOCK_N, BLOCK_K)
    tl.store(out_ptr + offs_n[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :], tile)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # 6 * 2^127 -> inf, on purpose
def test_every_code_under_every_scale_decodes_exactly():
    """All 256 bytes (two codes each) under every e8m0 exponent 0..254 (255 is NaN in the spec),
    subnormal (0: 2^-127) and overflowing (6 * 2^127 is inf in fp32) ends included."""
    scales = torch.arange(255, dtype=torch.uint8).repeat_interleave(16)[:, None]  # one per 32 values
    blocks = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16).repeat(255, 1)
    ref = dequantize_mxfp4(blocks, scales, torch.float32)
    n = blocks.numel()
    out = torch.empty(2 * n)
    _decode_kernel[(1,)](blocks.flatten(), scales.repeat_interleave(16, 1).flatten(), out, n,
                         BLOCK=triton.next_power_of_2(n))  # fmt: skip
    out = out.reshape(ref.shape)
    assert torch.equal(out, ref)
    assert out.isinf().any() and (out.abs() == 2.0**-128).any()  # both ends were decoded
    finite = out.isfinite()
    assert torch.equal(out[finite].to(torch.bfloat16).float(), out[finite])  # exact in bf16
    assert torch.equal(out.to(torch.bfloat16), dequantize_mxfp4(blocks, scales, torch.bfloat16))


@pytest.mark.parametrize("k0", [0, 64])
def test_a_tile_is_in_input_order_and_masked_past_the_row(k0):
    """Rows of 96 values (3 scale groups) as 64-value tiles: the second tile's last group is past the
    row's end and reads as zeros; rows past ROWS too."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 96, generator=g) * torch.logspace(-4, 4, 96, base=2.0)  # groups' scales differ
    blocks, scales = quantize_mxfp4(w)
    ref = torch.zeros(8, 128)
    ref[:5, :96] = dequantize_mxfp4(blocks, scales, torch.float32)
    out = torch.empty(8, 64)
    _tile_kernel[(1,)](blocks, scales, out, k0, 96, blocks.stride(0), scales.stride(0), 5, BLOCK_N=8, BLOCK_K=64)
    assert torch.equal(out, ref[:, k0 : k0 + 64])
    assert len(set(scales[0].tolist())) == 3
