"""AITER (ROCm) kernels behind atomc ops. UNTESTED ON AMD HARDWARE: the wrappers follow AITER's
documented signatures (keyword arguments, since positional order drifts between releases) and are
checked only against a stand-in `aiter` module on CPU (tests/kernels/test_aiter_wrappers.py).
`ops.py` holds norms, activation and RoPE; `attention.py` attention and the KV-cache write; `moe.py`
the mixture-of-experts block; `moe_quant.py` the block with quantised (FP8, MXFP4) experts; `mla.py`
MLA attention; `fp8.py` the FP8 quants and GEMMs; `fallback.py` the next backend each hands
what AITER cannot run."""

from __future__ import annotations

from atomc.platforms import aiter_importable


def aiter_available() -> bool:
    """ROCm torch and an importable aiter (atomc.platforms.aiter_importable: the loader asks the same
    question before laying quantised weights out for AITER)."""
    return aiter_importable()
