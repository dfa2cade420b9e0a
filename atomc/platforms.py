"""Which platform serves a device: "cpu", "cuda" (NVIDIA) or "rocm" (AMD). The kernel registry picks
backends per platform, and the platform is a compile-cache factor."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is needed (see gpu_device_nodes_present)
    import torch

PLATFORMS = ("cpu", "cuda", "rocm")


def platform_of(device: str) -> str:
    """cpu, cuda, or rocm (a ROCm torch calls its GPUs cuda)."""
    if not str(device).startswith("cuda"):
        return "cpu"
    import torch

    return "rocm" if torch.version.hip else "cuda"


def gpu_device_nodes_present() -> bool:
    """Whether this machine shows an NVIDIA or AMD GPU device node, without importing torch (about
    5 s with CUDA's initialisation). For choices that only cost speed when wrong (`atomc serve`
    starting its engine process at once); torch decides the device itself."""
    import os

    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd")


@functools.cache
def aiter_importable() -> bool:
    """ROCm torch and an importable aiter (the import JIT-builds modules and fails without ROCm)."""
    import torch

    if torch.version.hip is None:
        return False
    try:
        import aiter  # noqa: F401
    except Exception:  # ImportError, or AITER's own errors when ROCm pieces are missing
        return False
    return True


def uses_aiter(device) -> bool:
    """Whether `device` runs atomc's AITER backend: a ROCm GPU where `import aiter` works, the
    platform whose graphs the kernel registry lowers to AITER first. Quantised weights loaded onto
    such a device are laid out once for AITER's pre-shuffled kernels (models/quant/aiter.py)."""
    return platform_of(device) == "rocm" and aiter_importable()


def fp8_dtype(device) -> torch.dtype:
    """The e4m3 dtype a device's FP8 GEMMs take: float8_e4m3fnuz on MI300 (gfx94x), which has no
    float8_e4m3fn arithmetic, else float8_e4m3fn (NVIDIA, MI350 gfx950, CPU). As AITER decides it
    (aiter.dtypes.fp8: gfx942 -> fnuz, the rest fn)."""
    import torch

    if torch.version.hip and str(device).startswith("cuda"):
        index = torch.device(device).index
        arch = torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device())
        if getattr(arch, "gcnArchName", "").startswith("gfx94"):
            return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn
