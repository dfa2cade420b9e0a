"""`atomc_triton::fp8_gemm`: the FP8 GEMM on NVIDIA GPUs, through torch._scaled_mm (cuBLASLt).

Registered in the GPU backend's namespace beside the Triton bindings (as `atomc_triton::linear`
also calls the vendor GEMM for more than one row), so lowering picks it on CUDA like any other
backend op; and as atomc::fp8_gemm's CUDA kernel, so an eager model runs it too. Per-tensor scales
on both sides run the tensorwise GEMM; any row scale (per-token activations, per-channel weights,
the per-shard scales of a merged layer) runs the rowwise one with both scales expanded to rows.
Where _scaled_mm cannot run (a GPU before sm_89, ROCm's e4m3fnuz, a dimension not a multiple of
16, an fp32 output with row scales) the reference runs instead.
Later: a Triton FP8 GEMV for one-row decode (issue 16).
"""

from __future__ import annotations

import functools

import torch

from atomc.kernels.triton.ops import custom
from atomc.ops import fp8 as ref


@functools.cache
def _scaled_mm_supported(device_index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index) >= (8, 9)


def scaled_mm(xq, x_scale, weight, weight_scale, bias, out_dtype):
    """torch._scaled_mm for [..., K] x [N, K], or None where it does not apply."""
    n, k = weight.shape
    if not xq.is_cuda or not _scaled_mm_supported(xq.device.index or 0) or n % 16 or k % 16:
        return None
    x2 = xq.reshape(-1, k)
    m = x2.shape[0]
    tensorwise = x_scale.numel() == 1 and weight_scale.numel() == 1
    if not tensorwise and out_dtype != torch.bfloat16:
        return None
    if tensorwise:
        sa, sb = x_scale.float().reshape(()), weight_scale.float().reshape(())
    else:
        sa = x_scale.float().reshape(-1, 1).expand(m, 1).contiguous()
        sb = weight_scale.float().reshape(1, -1).expand(1, n).contiguous()
    out = torch._scaled_mm(x2, weight.t(), sa, sb, out_dtype=out_dtype)
    if bias is not None:
        out = out + bias.to(out_dtype)
    return out.reshape(*xq.shape[:-1], n)


@custom("fp8_gemm")
def fp8_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    out = scaled_mm(xq, x_scale, weight, weight_scale, bias, out_dtype)
    if out is None:
        out = ref.fp8_gemm_reference(xq, x_scale, weight, weight_scale, bias, out_dtype)
    return out


# the eager model's atomc::fp8_gemm on CUDA runs the same GEMM as a lowered graph
torch.library.register_kernel("atomc::fp8_gemm", "cuda", fp8_gemm)
