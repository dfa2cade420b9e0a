"""The `@triton.jit` pieces every fused-MoE expert kernel shares: the weight tile of each expert
weight format, the bias row, and the rounding + activation epilogue of gate/up.

A kernel takes the format as a constexpr (`WEIGHTS`: DENSE, FP8_ROW, FP8_BLOCK, MXFP4) and calls
`weight_tile`; the branch is resolved at compile time, so the bf16 kernels compile to the plain
load they always did and each quantised format adds only its own dequantisation.

MXFP4 (e2m1 pairs a byte, low nibble = the even value; one e8m0 exponent per 32 values) is decoded
by bit arithmetic, no table and no float conversion of the code: the nibble's three magnitude bits
go to fp32 bits 24-22 and its sign to bit 31, which reads as exactly e2m1 * 2^-126 (the one
subnormal code, 0.5, becomes the fp32 subnormal 2^-127, which is why the rebias is a multiply, not
an exponent add); one multiply by 2^126 and one by the group's scale 2^(s - 127) (built once per
32 values from the scale's bits, no exp2) give the dequantised value, exact in fp32 and in bf16.
A tile is loaded as [BLOCK_N, BLOCK_K / 32, 16] bytes, 16 contiguous bytes (one scale group) on
the innermost axis so the load is vectorised, with its scales as one [BLOCK_N, BLOCK_K / 32] load;
the two nibble planes are interleaved (`tl.join`) back into input order for the tensor-core dot.
An e8m0 byte of 255 (NaN in the OCP spec) reads as +inf; scales 2^-127..2^127 are exact.
"""

from __future__ import annotations

import triton
import triton.language as tl

DENSE, FP8_ROW, FP8_BLOCK, MXFP4 = 0, 1, 2, 3
# atomc::moe_quant's weight_format -> the kernels' WEIGHTS code ("" = weights in x's dtype)
WEIGHT_CODES = {"": DENSE, "fp8_channel": FP8_ROW, "fp8_block": FP8_BLOCK, "mxfp4": MXFP4}
MXFP4_GROUP = 32  # values per e8m0 scale (16 bytes)
ACT_SILU, ACT_SWIGLU_OAI = 0, 1
TWO_POW_126 = tl.constexpr(2.0**126)  # exact in fp32; a constexpr so jit code may read it


@triton.jit
def e4m3_grid(v):
    """fp32 v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, still fp32: what a
    round-to-nearest fp32 -> e4m3 cast gives, in integer arithmetic, so the cast after it is exact
    on every backend (the Triton interpreter's own cast drops the carry into the exponent: 124.8
    became 64). Normals keep 3 mantissa bits; below 2^-6 the grid is multiples of 2^-9."""
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) & 0x7FF00000) | (bits & -0x80000000)
    sub = ((v * 512.0 + 12582912.0) - 12582912.0) / 512.0  # + 1.5 * 2^23: rounds to an integer, ties to even
    return tl.where(mag < 0x3C800000, sub, normal.to(tl.float32, bitcast=True))


@triton.jit
def e4m3_scale(amax):
    """The dynamic FP8 scale of values with this max |value|: amax / 448, 1 where amax is 0 (padding
    rows, zero groups) so the quotient stays finite."""
    return tl.where(amax > 0, amax / 448.0, 1.0)


@triton.jit
def quantize_e4m3(a, scale):
    """a [M, K] fp32 / scale [M] as float8e4nv, rounded to nearest even (e4m3_grid)."""
    v = tl.minimum(tl.maximum(a / scale[:, None], -448.0), 448.0)
    return e4m3_grid(v).to(tl.float8e4nv)


@triton.jit
def activate(gate, up, alpha, limit, ACT: tl.constexpr):
    """silu(gate) * up, or GPT-OSS's: gate clamped above, up both ways, gate * sigmoid(alpha * gate) * (up + 1)."""
    if ACT == 0:
        return gate / (1.0 + tl.exp(-gate)) * up
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return gate / (1.0 + tl.exp(-alpha * gate)) * (up + 1.0)


@triton.jit
def round_activate(acc_g, acc_u, alpha, limit, dtype: tl.constexpr, ACT: tl.constexpr):
    """The activation of fp32 gate/up sums, each first rounded to `dtype` as the reference's GEMM output is."""
    return activate(acc_g.to(dtype).to(tl.float32), acc_u.to(dtype).to(tl.float32), alpha, limit, ACT)


@triton.jit
def bias_row(b, offs, ok):
    """The bias row at `b` (an expert's bias, or its up half) at `offs`, fp32 (1-D, as offs)."""
    return tl.load(b + offs, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def e8m0_scale(s):
    """e8m0 exponent bytes -> fp32 2^(s - 127), from the bits (0 is the subnormal 2^-127)."""
    s = s.to(tl.int32)
    return tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_pair(byte, scale):
    """(low-nibble values, high-nibble values), fp32, of uint8 e2m1 pairs times `scale` (broadcast)."""
    c = byte.to(tl.int32)
    lo = ((c << 22) & 0x01C00000) | ((c << 28) & -0x80000000)  # bits 2-0 -> 24-22, bit 3 -> 31
    hi = ((c << 18) & 0x01C00000) | ((c << 24) & -0x80000000)  # bits 6-4 -> 24-22, bit 7 -> 31
    lo = lo.to(tl.float32, bitcast=True) * TWO_POW_126 * scale
    hi = hi.to(tl.float32, bitcast=True) * TWO_POW_126 * scale
    return lo, hi


@triton.jit
def mxfp4_groups(w_rows, s_rows, n_ok, k0, K, BLOCK_K: tl.constexpr, UNITS: tl.constexpr):
    """The scale groups of input values k0 .. k0 + BLOCK_K (k0 a multiple of 32; K, the row's values,
    too) of the rows w_rows / s_rows ([BLOCK_N, 1] pointers to each row's packed values / scales):
    a group's 16 bytes as UNITS elements of w_rows' type [BLOCK_N, BLOCK_K / 32, UNITS] (16 uint8,
    or 4 int32 words), and fp32 scales [BLOCK_N, BLOCK_K / 32]."""
    G: tl.constexpr = BLOCK_K // 32
    grp = k0 // 32 + tl.arange(0, G)
    g_ok = grp < K // 32
    offs = grp[:, None] * UNITS + tl.arange(0, UNITS)[None, :]
    tile = tl.load(w_rows[:, :, None] + offs[None, :, :], mask=n_ok[:, None, None] & g_ok[None, :, None], other=0)
    s = tl.load(s_rows + grp[None, :], mask=n_ok[:, None] & g_ok[None, :], other=127)
    return tile, e8m0_scale(s)


@triton.jit
def mxfp4_bytes(w_rows, s_rows, n_ok, k0, K, BLOCK_K: tl.constexpr):
    """The packed bytes uint8 [BLOCK_N, BLOCK_K / 32, 16] and fp32 scales [BLOCK_N, BLOCK_K / 32, 1]
    of input values k0 .. k0 + BLOCK_K (`mxfp4_groups`, w_rows uint8 pointers)."""
    byte, scale = mxfp4_groups(w_rows, s_rows, n_ok, k0, K, BLOCK_K, 16)
    return byte, scale[:, :, None]


@triton.jit
def mxfp4_tile(w_rows, s_rows, n_ok, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Dequantised fp32 [BLOCK_N, BLOCK_K] of input values k0 .. (see mxfp4_bytes), in input order."""
    byte, scale = mxfp4_bytes(w_rows, s_rows, n_ok, k0, K, BLOCK_K)
    lo, hi = e2m1_pair(byte, scale)
    return tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))  # [N, G, 16, 2]: value 2b, 2b + 1 of byte b


@triton.jit
def block_scales_at(s_base, rows, n_ok, k0, stride_sn, stride_sk):
    """[BLOCK_N] 128x128-block scales of these rows (their numbers in the expert's stacked weight)
    at column k0."""
    return tl.load(s_base + (rows // 128) * stride_sn + (k0 // 128) * stride_sk, mask=n_ok, other=0.0)


@triton.jit
def fp8_tile(
    w_rows, s_base, rows, n_ok, k0, offs_k, k_ok, K, stride_sn, stride_sk, BLOCK_SCALES: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Dequantised fp32 [BLOCK_N, BLOCK_K] of fp8 rows times their per-row (one fp32 a row, loaded
    once a tile) or 128x128-block scale. rows: the tile's row numbers in the expert's stacked
    weight, which index the scales. Block scales: a tile of at most 128 columns (k0 a multiple of
    BLOCK_K, a power of two) lies in one column block, so one scale a row; a wider tile loads
    [BLOCK_N, BLOCK_K / 128] scales and multiplies its [BLOCK_N, BLOCK_K / 128, 128] view. Each
    element's scale gathered instead cost the tensor-core tiles a [BLOCK_N, BLOCK_K] fp32 tile of
    shared memory a stage (DeepSeek-V3's 128x128x64 tiles at 3 stages asked 240 KiB, over sm_90's
    227) and the one-token GEMVs a 4-byte load a weight byte."""
    mask = n_ok[:, None] & k_ok[None, :]
    w = tl.load(w_rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    if BLOCK_SCALES and BLOCK_K <= 128:
        out = w * block_scales_at(s_base, rows, n_ok, k0, stride_sn, stride_sk)[:, None]
    elif BLOCK_SCALES:
        G: tl.constexpr = BLOCK_K // 128
        grp = k0 // 128 + tl.arange(0, G)
        s = tl.load(s_base + (rows // 128)[:, None] * stride_sn + grp[None, :] * stride_sk,
                    mask=n_ok[:, None] & (grp * 128 < K)[None, :], other=0.0)  # fmt: skip
        out = tl.reshape(tl.reshape(w, (BLOCK_N, G, 128)) * s[:, :, None], (BLOCK_N, BLOCK_K))
    else:
        out = w * tl.load(s_base + rows * stride_sn, mask=n_ok, other=0.0)[:, None]
    return out


@triton.jit
def weight_tile(
    w_rows, s_base, rows, n_ok, k0, K, stride_sn, stride_sk, dtype: tl.constexpr, WEIGHTS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The weights [BLOCK_N, BLOCK_K] of input columns k0 .. k0 + BLOCK_K of the rows `rows` (this
    expert's row numbers, [BLOCK_N]; `w_rows` [BLOCK_N, 1] their pointers: elements for DENSE and
    FP8, bytes for MXFP4; `s_base` the expert's scales). DENSE: as stored; quantised formats:
    dequantised and rounded to `dtype` (exact for MXFP4; FP8 as the reference rounds it)."""
    if WEIGHTS == 3:  # MXFP4
        s_rows = s_base + rows[:, None] * stride_sn
        return mxfp4_tile(w_rows, s_rows, n_ok, k0, K, BLOCK_N, BLOCK_K).to(dtype)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    if WEIGHTS == 0:
        return tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    return fp8_tile(w_rows, s_base, rows, n_ok, k0, offs_k, k_ok, K, stride_sn, stride_sk, WEIGHTS == 2, BLOCK_N,
                    BLOCK_K).to(dtype)  # fmt: skip
