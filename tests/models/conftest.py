"""Fixtures for checkpoint conversion: one model cache per session, and the default model in it.

Set ATOMC_TEST_CACHE to a folder to keep converted models between runs (local loops, CI caches);
otherwise each session converts into a fresh temporary folder.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def model_cache_root(tmp_path_factory) -> Path:
    env = os.environ.get("ATOMC_TEST_CACHE")
    if env:
        root = Path(env).expanduser()
        root.mkdir(parents=True, exist_ok=True)
        return root
    return tmp_path_factory.mktemp("atomc-cache")


@pytest.fixture(scope="session")
def default_model(model_cache_root) -> Path:
    """The default model's HF folder (SmolLM2-135M-Instruct), converted once per cache."""
    from models.loader.default_model import default_model_dir

    start = time.perf_counter()
    path = default_model_dir(model_cache_root)
    print(f"default model ready in {time.perf_counter() - start:.1f}s: {path}")
    return path
