"""The FP8 (e4m3) KV cache's runtime side: where it can run, and each layer's k and v scale.

The pages hold k / k_scale and v / v_scale (one fp32 scale each per layer, vLLM's semantics); the
kernels find the scales in the forward context (`ForwardContext.kv_scales`), as device tensors
made once here, so CUDA graphs replay against the same ones. Scales come from the checkpoint
(`model.kv_cache_scales`, read by models/loader/kv_scales.py); a layer without them gets 1.0, which
stores K and V as they are, rounded to e4m3 and saturated at ±448 (docs/quantization.md: what
that means for accuracy), and the runner says so once.

An MLA layer (DeepSeek's latent cache) caches one row [c_kv | k_pe] that is both its key and (the
c_kv part) its value, so it has one scale for the whole row: the checkpoint's k_scale (or kv_scale),
as vLLM does; a v_scale it ships is not used. Its pair is that one tensor twice.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from atomc.kv_spec import FP8_KV_DTYPE, KVCacheSpec, MLAAttentionSpec

log = logging.getLogger(__name__)


def check_fp8_kv_supported(specs: Sequence[KVCacheSpec], device: str, platform: str) -> None:
    """Refuse an FP8 KV cache where atomc does not build one (clear errors, before any allocation)."""
    if platform == "rocm" and any(isinstance(spec, MLAAttentionSpec) for spec in specs):
        raise ValueError(
            "--kv-cache-dtype fp8 is not supported for MLA models (DeepSeek's latent cache) on ROCm yet "
            "(AITER's MLA kernels are not given an e4m3 latent cache); use --kv-cache-dtype auto"
        )
    if platform == "rocm":
        raise ValueError(
            "--kv-cache-dtype fp8 is not supported on ROCm yet (the AITER attention path and e4m3fnuz); "
            "use --kv-cache-dtype auto"
        )
    if platform == "cuda" and torch.cuda.get_device_capability(torch.device(device)) < (8, 9):
        raise ValueError("--kv-cache-dtype fp8 needs an sm_89+ GPU (e4m3: Ada, Hopper or newer)")


def kv_scale_tensors(
    checkpoint_scales: dict[int, dict[str, float]], specs: Sequence[KVCacheSpec | None], device: str | torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_scale, v_scale), fp32 [1] on `device`: the checkpoint's, else 1.0 (logged once).
    An MLA layer's pair is its one latent scale (the k scale) twice."""
    scales, defaulted = [], []
    num_layers = len(specs)
    for layer, spec in enumerate(specs):
        got = checkpoint_scales.get(layer, {})
        if isinstance(spec, MLAAttentionSpec):
            if "k" not in got:
                defaulted.append(layer)
            latent = torch.tensor([got.get("k", 1.0)], dtype=torch.float32, device=device)
            scales.append((latent, latent))
            continue
        if "k" not in got or "v" not in got:
            defaulted.append(layer)
        pair = [torch.tensor([got.get(which, 1.0)], dtype=torch.float32, device=device) for which in ("k", "v")]
        scales.append((pair[0], pair[1]))
    if defaulted:
        log.warning(
            "FP8 KV cache: the checkpoint has no k/v scales for %d of %d layers; they use 1.0 (K and V "
            "rounded to e4m3 as they are, saturating at ±448). A checkpoint calibrated for an FP8 KV "
            "cache ships them (e.g. llmcompressor's kv_cache_scheme)",
            len(defaulted), num_layers,
        )  # fmt: skip
    return scales


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_KV_DTYPE
