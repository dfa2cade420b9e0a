"""Hand-written kernels the compiler's passes swap in for torch patterns (see docs/kernels.md).

Importing this package does not import Triton: the registry and the platform check are needed on
every machine, the Triton kernels only where they run.
"""

__all__ = ["TRITON_AVAILABLE"]


def __getattr__(name: str):
    if name == "TRITON_AVAILABLE":
        from atomc.kernels.triton import TRITON_AVAILABLE

        return TRITON_AVAILABLE
    raise AttributeError(name)
