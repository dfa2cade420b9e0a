"""The MXFP4 decode of the MoE kernels (atomc/kernels/triton/moe_tiles.py) on CPU through the Triton
interpreter: every e2m1 code under every e8m0 scale against atomc::moe_quant's dequantiser
(both exact, so equal: e2m1 times a power of two needs 2 significant bits), the decoded fp32
values exact in bf16 (the tensor-core route rounds them to bf16 losslessly), and a tile of
`mxfp4_tile` in input order with its scale groups, including a tile past the row's end."""

import pytest
import torch
from triton_interpreter import use_interpreter

use_interpreter()  # before the first triton import

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


# ---- the packed-f16 step (atomc/kernels/triton/mxfp4_packed.py) ----

from atomc.kernels.triton import mxfp4_packed, packed_f16  # noqa: E402

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


@triton.jit
def _pairs_kernel(w_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    w = tl.load(w_ptr + offs)
    for i in tl.static_range(4):
        tl.store(out_ptr + i * N + offs, mxfp4_packed.e2m1_f16x2(w, i))


def test_a_word_decodes_to_four_exact_f16_pairs():
    """Every byte value in every position of a word: pair I holds nibble I (low half) and nibble
    I + 4 (high half), each exactly e2m1 * 2^-14 (the code 0.5 is f16's subnormal 2^-15)."""
    g = torch.Generator().manual_seed(0)
    b = torch.stack([torch.arange(256).roll(r) for r in (0, 37, 101, 200)], 1).to(torch.uint8)  # [256, 4] bytes
    b = torch.cat([b, torch.randint(0, 256, (256, 4), generator=g).to(torch.uint8)])
    words = b.contiguous().view(torch.int32).reshape(-1)
    out = torch.empty(4, words.numel(), dtype=torch.int32)
    _pairs_kernel[(1,)](words, out, N=words.numel())
    halves = out.contiguous().view(torch.float16).reshape(4, -1, 2).float()  # little-endian: low half first
    nib = torch.stack([b.int() & 15, b.int() >> 4], -1).reshape(-1, 8)  # nibble i = value i of the word
    want = E2M1[nib & 7] * torch.where(nib >= 8, -1.0, 1.0) * 2.0**-14
    for i in range(4):
        assert torch.equal(halves[i, :, 0], want[:, i]) and torch.equal(halves[i, :, 1], want[:, i + 4])


@triton.jit
def _group_sums_kernel(x_ptr, w_ptr, s_ptr, out_ptr, K, stride_wn, stride_sn, ROWS, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):  # fmt: skip
    offs_n = tl.arange(0, BLOCK_N)
    n_ok = offs_n < ROWS
    rows = offs_n.to(tl.int64)[:, None]
    w32 = (w_ptr + rows * stride_wn).to(tl.pointer_type(tl.int32))
    mult, undo = packed_f16.x_shift(x_ptr, K, BLOCK_K, mxfp4_packed.X_TOP)
    acc = tl.zeros((BLOCK_N, BLOCK_K // 32), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x0, x1, x2, x3 = mxfp4_packed.x_pairs(x_ptr, k0, K, mult, BLOCK_K)
        words, scale = mxfp4_packed.mxfp4_words(w32, s_ptr + rows * stride_sn, n_ok, k0, K, BLOCK_K)
        acc += mxfp4_packed.group_sums(words, x0, x1, x2, x3, False) * scale
    tl.store(out_ptr + offs_n, tl.sum(acc, 1) * (undo * mxfp4_packed.E2M1_UNDO), mask=n_ok)


@pytest.mark.parametrize("magnitude", [1e-6, 1.0, 3e4])
def test_packed_rows_match_the_dequantised_dot_at_any_input_magnitude(magnitude):
    """Rows of 96 values (3 scale groups, the last 64-value step half past the row) dotted with x of
    bf16 values at 1e-6, 1 or 3e4 (f16 holds neither end: x_shift moves x into its range): the
    dequantised fp32 dot within 2e-3, the f16 rounding of a group's sums (2^-11 a step)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(5, 96, generator=g) * torch.logspace(-4, 4, 96, base=2.0)
    blocks, scales = quantize_mxfp4(w)
    x = (torch.randn(96, generator=g) * magnitude).to(torch.bfloat16).float()  # bf16 values, as in the engine
    want = dequantize_mxfp4(blocks, scales, torch.float32) @ x
    out = torch.empty(8)
    _group_sums_kernel[(1,)](x, blocks, scales, out, 96, blocks.stride(0), scales.stride(0), 5, BLOCK_N=8,
                             BLOCK_K=64)  # fmt: skip
    err = (out[:5] - want).norm() / want.norm()
    assert err < 2e-3, err
