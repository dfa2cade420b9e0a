"""FP8 GEMMs whose weight is in AITER's pre-shuffled layout: `fp8_gemm_shuffled`, `fp8_block_gemm_shuffled`.

Same arguments and values as atomc::fp8_gemm / fp8_block_gemm (atomc/ops/fp8.py), except that
`weight` [N, K] holds its e4m3 bytes in shuffle_weight(layout=(16, 16)) order
(atomc/ops/aiter_layout.py). The loader writes that layout once, only on a ROCm GPU that runs AITER
(models/quant/fp8.py, models/quant/aiter.py), and the linear then emits these ops instead of the
row-major ones, so the graph says what the weight tensor holds: every backend either reads the
layout (AITER's gemm_a8w8_bpreshuffle / gemm_a8w8_blockscale_bpreshuffle,
atomc/kernels/aiter/fp8.py) or runs this reference, which unshuffles the weight first (a copy per
call: for an eager run, or a call AITER declines). Triton has no kernel for them.
"""

from __future__ import annotations

import torch

from atomc.ops.aiter_layout import unshuffle_16x16
from atomc.ops.fp8 import fp8_block_gemm_fake, fp8_block_gemm_reference, fp8_gemm_fake, fp8_gemm_reference

SHUFFLED_GEMMS = {"fp8_gemm_shuffled": "fp8_gemm", "fp8_block_gemm_shuffled": "fp8_block_gemm"}


@torch.library.custom_op("atomc::fp8_gemm_shuffled", mutates_args=())
def fp8_gemm_shuffled(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """atomc::fp8_gemm with `weight` in shuffle_weight(layout=(16, 16)) order."""
    return fp8_gemm_reference(xq, x_scale, unshuffle_16x16(weight), weight_scale, bias, out_dtype)


fp8_gemm_shuffled.register_fake(fp8_gemm_fake)  # the shuffled weight keeps its [N, K] shape


@torch.library.custom_op("atomc::fp8_block_gemm_shuffled", mutates_args=())
def fp8_block_gemm_shuffled(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_n: int,
    block_k: int,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """atomc::fp8_block_gemm with `weight` in shuffle_weight(layout=(16, 16)) order."""
    weight = unshuffle_16x16(weight)
    return fp8_block_gemm_reference(xq, x_scale, weight, weight_scale, block_n, block_k, bias, out_dtype)


fp8_block_gemm_shuffled.register_fake(fp8_block_gemm_fake)
