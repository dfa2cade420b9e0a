"""AITER (ROCm) kernels behind atomc ops. UNTESTED ON AMD HARDWARE: the wrappers follow AITER's
documented signatures (keyword arguments, since positional order drifts between releases) and are
checked only against a stand-in `aiter` module on CPU (tests/kernels/test_aiter_wrappers.py).
`ops.py` holds norms, activation and RoPE; `attention.py` attention and the KV-cache write; `moe.py`
the mixture-of-experts block; `mla.py` MLA attention; `fp8.py` the FP8 quants and GEMMs."""

from __future__ import annotations

import functools


@functools.cache
def aiter_available() -> bool:
    """ROCm torch and an importable aiter (the import JIT-builds modules and fails without ROCm)."""
    import torch

    if torch.version.hip is None:
        return False
    try:
        import aiter  # noqa: F401
    except Exception:  # ImportError, or AITER's own errors when ROCm pieces are missing
        return False
    return True
