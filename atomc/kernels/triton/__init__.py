"""Triton kernels (NVIDIA and portable). Importing this package never fails: without triton,
TRITON_AVAILABLE is False and the kernel names are absent, so callers fall back to torch ops."""

try:
    import triton  # noqa: F401
except ImportError:  # e.g. macOS or a minimal CPU install
    TRITON_AVAILABLE = False
else:
    TRITON_AVAILABLE = True
    from atomc.kernels.triton.activation import silu_and_mul
    from atomc.kernels.triton.gemv import linear
    from atomc.kernels.triton.head_matmul import head_matmul
    from atomc.kernels.triton.kv_cache_write import write_kv_cache
    from atomc.kernels.triton.latent_norm_rope import mla_latent_norm_rope
    from atomc.kernels.triton.mla_attention import mla_attention
    from atomc.kernels.triton.mla_latent_write import write_latent_cache
    from atomc.kernels.triton.moe import fused_experts, fused_moe
    from atomc.kernels.triton.paged_attention import paged_attention
    from atomc.kernels.triton.rmsnorm import fused_add_rms_norm, rms_norm
    from atomc.kernels.triton.rope import rope, rope_and_write_kv

    __all__ = [
        "fused_add_rms_norm",
        "fused_experts",
        "fused_moe",
        "head_matmul",
        "linear",
        "mla_attention",
        "mla_latent_norm_rope",
        "paged_attention",
        "rms_norm",
        "rope",
        "rope_and_write_kv",
        "silu_and_mul",
        "write_kv_cache",
        "write_latent_cache",
    ]
