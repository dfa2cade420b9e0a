"""`atomc::linear`: F.linear as an op a backend may implement with its own kernels.

Only the decode_gemv pass rewrites to it, on platforms where a backend measured faster than the
vendor GEMM for some shapes (the triton GEMV at one row on the H200). Everywhere else F.linear
stays a plain aten call that Inductor sees through.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("atomc::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@linear.register_fake
def _(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
