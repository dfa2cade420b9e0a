"""The range step of the one-row loops that multiply in packed f16 (f16x2 FMAs, half the
instructions of widening every weight to fp32): x in bf16 can exceed f16's 65,504 or sink below
its normals, so a loop first scales x by a power of two picked from its largest |value| (exact for
bf16 values) and undoes it on the fp32 result. Used by the MXFP4 step (mxfp4_packed.py) and the
FP8 expert GEMVs (moe_gemv.py); the dense FP8 GEMV's x is e4m3, bounded by 448, so its shift is
fixed on the host (`e4m3_x_shift`)."""

from __future__ import annotations

import triton
import triton.language as tl

E4M3_MAX, F16_MAX = 448.0, 65504.0


def e4m3_x_shift(k: int, block_k: int) -> float:
    """For e4m3 x and weights (fp8_gemv's packed-f16 loop, gemv.row_dot in float16): the power of
    two on x that keeps a column's t = ceil(K / BLOCK_K) partial products of at most
    448 * 448 * shift within f16."""
    t = triton.cdiv(k, block_k)
    shift = 1.0
    while t * E4M3_MAX * E4M3_MAX * shift > F16_MAX:
        shift /= 2
    return shift


def e4m3_weight_x_top(k: int, block_k: int) -> int:
    """For e4m3 weights and bf16 x (moe_gemv.py's packed loop): the TOP of x_shift, |x'| < 2^TOP,
    that keeps a column's ceil(K / BLOCK_K) partial products of at most 448 * 2^TOP within f16."""
    t = triton.cdiv(k, block_k)
    top = 15
    while t * E4M3_MAX * 2.0**top > F16_MAX:
        top -= 1
    return top


@triton.jit
def x_shift(x_row, K, BLOCK_K: tl.constexpr, TOP: tl.constexpr):
    """(2^(TOP - E), 2^(E - TOP)) as fp32 scalars, E the exponent of max |x[:K]| (max < 2^E): the
    power of two that puts every |x'| under 2^TOP (f16's range for the packed loops: exact for bf16
    x) and its inverse. One pass over x."""
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)))
    return shift_for(tl.max(amax), TOP)


@triton.jit
def shift_for(amax, TOP: tl.constexpr):
    """x_shift's pair for a given max |x'| (fp32 scalar, >= 0)."""
    f = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # the biased exponent: max in [2^(f-127), 2^(f-126))
    f = tl.minimum(tl.maximum(f, TOP), TOP + 252)  # zero or tiny x: any finite shift
    return ((253 - f + TOP) << 23).to(tl.float32, bitcast=True), ((f + 1 - TOP) << 23).to(tl.float32, bitcast=True)
