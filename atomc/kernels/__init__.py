"""Hand-written kernels the compiler's passes swap in for torch patterns (see docs/kernels.md)."""

from atomc.kernels.triton import TRITON_AVAILABLE

__all__ = ["TRITON_AVAILABLE"]
