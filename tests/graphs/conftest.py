"""Shared compiled entries: CPU compiles take 10-40 s, so each test reuses what a fixture built once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from atomc.graphs import build
from models.loader import load_model
from tests.graphs.helpers import make_config


@pytest.fixture(scope="session")
def shared_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("atomc_cache")


@pytest.fixture(scope="session")
def compiled(shared_root, llama_dir):
    """The tiny llama compiled once (cold) into the shared cache: (config, CompileResult)."""
    cfg = make_config(shared_root)
    model = load_model(llama_dir, torch.float32, "cpu")
    res = build.compile_or_load(model, llama_dir, cfg, "cpu", torch.float32)
    assert not res.hit
    return cfg, res
