"""MXFP4 one-token GEMV steps on packed f16 pairs: e2m1 decoded a 32-bit word at a time.

Why: the fp32 step (moe_mxfp4_gemv.py) spends ~16.5 sm_90 instructions a weight byte on per-byte
bit work and two fp32 multiplies a value (`benchmarks/moe_sass.py`), so the GEMVs read 0.5-0.8
TB/s on an H100 (docs/performance.md section 16). Here a word of 8 nibbles (values 8q .. 8q + 7
of a scale group, nibble i = value i) gives four f16 pairs: pair I holds nibbles I and I + 4,
which sit 16 bits apart, so one shift places both magnitudes and one both signs:

    pair_I = ((w << (9 - 4I)) & 0x0E000E00) | ((w << (12 - 4I)) & 0x80008000)

reads as e2m1 * 2^-14 in each half, exactly (the code 0.5 is the f16 subnormal 2^-15). Each pair
meets x's pair (values I and I + 4 of the word) in one f16x2 FMA; a group's 16 FMAs sum in f16
(four a word, then the four words), and the group's sum times its scale 2^(s - 127) goes into
fp32. Compiled for sm_90 the gate/up loop runs 264 instructions for a thread's 32 weight bytes
(8.3 a byte, 34 of them f16x2 FMAs) against the fp32 step's 538 (`benchmarks/moe_sass.py`).

Range: x is scaled by 2^(15 - E), E the exponent of its largest |value| (`packed_f16.x_shift`, TOP 15,
from one pass over x), so |x'| < 2^15 fits f16 (a power of two: exact for bf16 x), and a group's sum of 32
products stays under 32 * 6 * 2^-14 * 2^15 = 384. Products are exact (2 significant bits of e2m1
times 8 of bf16); the group's f16 sums round (2^-11 relative a step): the one rounding this adds
to the fp32 step, well under bf16's own (the output's) 2^-9.

On CUDA the FMA and the add are `fma.rn.f16x2` / `add.rn.f16x2` (ASM=True); without PTX (the
Triton interpreter, so the CPU tests) the same operations are emulated on the two halves in fp32,
rounded once to f16: the same values, since every product is exact.
"""

from __future__ import annotations

import triton
import triton.language as tl

from atomc.kernels.triton.moe_tiles import mxfp4_groups

MAG_MASK = tl.constexpr(0x0E000E00)
X_TOP = tl.constexpr(15)  # |x'| < 2^15; a group's sum stays under 32 * 6 * 2^-14 * 2^15 = 384
E2M1_UNDO = tl.constexpr(2.0**14)  # e2m1_f16x2 reads e2m1 * 2^-14
SIGN_MASK = tl.constexpr(-0x7FFF8000)  # 0x80008000 as an int32


@triton.jit
def e2m1_f16x2(w, PAIR: tl.constexpr):
    """int32 words of 8 e2m1 nibbles -> int32 f16 pairs: nibble PAIR (low half), PAIR + 4 (high)."""
    if PAIR < 3:
        mag = (w << (9 - 4 * PAIR)) & MAG_MASK
    else:
        mag = (w >> 3) & MAG_MASK  # the arithmetic shift's sign fill lies outside the mask
    return mag | ((w << (12 - 4 * PAIR)) & SIGN_MASK)


@triton.jit
def _lo(v):
    return v.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _hi(v):
    return (v >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def pack_f16x2(lo, hi):
    """Two fp32 tensors -> int32 f16 pairs (each rounded to nearest once)."""
    lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi16 = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return lo16 | (hi16 << 16)


@triton.jit
def fma_f16x2(a, b, c, ASM: tl.constexpr):
    """a * b + c on int32 f16 pairs, rounded once a half."""
    if ASM:
        return tl.inline_asm_elementwise(
            "fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
        )
    return pack_f16x2(_lo(a) * _lo(b) + _lo(c), _hi(a) * _hi(b) + _hi(c))


@triton.jit
def add_f16x2(a, b, ASM: tl.constexpr):
    if ASM:
        return tl.inline_asm_elementwise(
            "add.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1
        )
    return pack_f16x2(_lo(a) + _lo(b), _hi(a) + _hi(b))


@triton.jit
def f16x2_sum(v):
    """fp32: the two halves of int32 f16 pairs, added."""
    return _lo(v) + _hi(v)


@triton.jit
def x_pairs(x_row, k0, K, mult, BLOCK_K: tl.constexpr):
    """x values k0 .. k0 + BLOCK_K (k0 a multiple of 32), times mult, as four int32 [G, 4] tensors
    of f16 pairs: pair I of word q of group g holds values 32g + 8q + I and 32g + 8q + I + 4."""
    G: tl.constexpr = BLOCK_K // 32
    grp = k0 // 32 + tl.arange(0, G)
    offs = grp[:, None, None] * 32 + tl.arange(0, 4)[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    x = tl.load(x_row + offs, mask=(grp < K // 32)[:, None, None], other=0.0).to(tl.float32) * mult
    x = tl.reshape(x, (G, 4, 2, 2, 2))  # (g, q, h, b1, b0): value 8q + 4h + 2 b1 + b0
    even, odd = tl.split(x)  # b0
    p0, p2 = tl.split(even)  # b1: (g, q, h) of I = 0, 2
    p1, p3 = tl.split(odd)  # I = 1, 3
    return _pair_h(p0), _pair_h(p1), _pair_h(p2), _pair_h(p3)


@triton.jit
def _pair_h(t):
    lo, hi = tl.split(t)  # h: value I, value I + 4
    return pack_f16x2(lo, hi)


@triton.jit
def group_sums(words, x0, x1, x2, x3, ASM: tl.constexpr):
    """fp32 [BLOCK_N, G]: each row's dot of its scale groups' 32 values with x', words the rows'
    int32 [BLOCK_N, G, 4] (x' the pairs from x_pairs; the result still carries e2m1's 2^-14)."""
    acc = fma_f16x2(e2m1_f16x2(words, 0), x0[None, :, :], tl.zeros_like(words), ASM)
    acc = fma_f16x2(e2m1_f16x2(words, 1), x1[None, :, :], acc, ASM)
    acc = fma_f16x2(e2m1_f16x2(words, 2), x2[None, :, :], acc, ASM)
    acc = fma_f16x2(e2m1_f16x2(words, 3), x3[None, :, :], acc, ASM)
    w0, w1 = tl.split(tl.reshape(acc, (acc.shape[0], acc.shape[1], 2, 2)))
    s0, s1 = tl.split(add_f16x2(w0, w1, ASM))
    return f16x2_sum(add_f16x2(s0, s1, ASM))


@triton.jit
def mxfp4_words(w_rows, s_rows, n_ok, k0, K, BLOCK_K: tl.constexpr):
    """The int32 words [BLOCK_N, G, 4] and fp32 scales [BLOCK_N, G] of input values k0 .. k0 +
    BLOCK_K (`moe_tiles.mxfp4_groups`; w_rows int32 pointers to each row's bytes, 4-byte aligned)."""
    return mxfp4_groups(w_rows, s_rows, n_ok, k0, K, BLOCK_K, 4)
