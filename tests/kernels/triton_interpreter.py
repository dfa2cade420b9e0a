"""Kernel tests through the Triton interpreter: the setting a test module makes before triton's first
import."""

import os
import sys

import pytest
import torch


def use_interpreter() -> None:
    """Turn TRITON_INTERPRET=1 on for the calling test module, or skip the module: on a machine with
    CUDA (the setting is process-wide; the kernels' GPU test files cover CUDA), and where triton was
    imported without it (triton's own @jit helpers, tl.cdiv and the reductions, were built for a GPU
    at import time: run that file alone). Call it before the module's first triton import."""
    if torch.cuda.is_available():
        pytest.skip("interpreter tests run on machines without CUDA", allow_module_level=True)
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET=1; run this file alone", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"
