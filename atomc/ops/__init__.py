"""atomc's custom ops: the contract that models, passes and kernels share.

Importing this package registers every `torch.ops.atomc.*` op (schema + fake impl + reference).
"""

from atomc.ops import attention  # noqa: F401

# isort: split
# ops the passes rewrite to
from atomc.ops import activation, linear, moe, norm, paged_attention, rope, rope_kv  # noqa: F401

# isort: split
# DeepSeek's latent attention (torch reference only), the latent's norm + RoPE the passes fuse to,
# and the per-head products of its absorbed form
from atomc.ops import head_matmul, mla, mla_latent  # noqa: F401

# isort: split
# FP8 linears (quantised checkpoints, --quantization fp8), and their activation quant fused into
# RMSNorm / SiLU·mul, or into the linear that reads it (the passes rewrite to these)
from atomc.ops import fp8, fp8_fused, fp8_linear  # noqa: F401

# isort: split
# the FP8 GEMMs over AITER's pre-shuffled weight layout (weights laid out so on ROCm with AITER only)
from atomc.ops import fp8_shuffled  # noqa: F401

# isort: split
# MoE blocks with quantised experts (MXFP4, FP8)
from atomc.ops import moe_quant  # noqa: F401

# isort: split
# the tensor-parallel collectives (torch.distributed inside; the layers call them only at TP > 1),
# and the all-reduce + residual add + RMSNorm the passes fuse them into
from atomc.ops import all_reduce_norm, collective  # noqa: F401
