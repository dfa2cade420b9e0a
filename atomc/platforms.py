"""Which platform serves a device: "cpu", "cuda" (NVIDIA) or "rocm" (AMD). The kernel registry picks
backends per platform, and the platform is a compile-cache factor."""

from __future__ import annotations

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
