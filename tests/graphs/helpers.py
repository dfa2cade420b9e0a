"""Helpers shared by the graphs tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from atomc.config import EngineConfig
from atomc.graphs import signing


def signing_key() -> signing.SigningKey:
    """The test session's signing key (tests/conftest.py points ATOMC_CACHE_SIGNING_KEY_FILE at it)."""
    return signing.load_key()


def make_config(cache_dir: Path, **compile_kw) -> EngineConfig:
    cfg = EngineConfig(device="cpu")
    cfg.compile.cache_dir = str(cache_dir)
    for k, v in compile_kw.items():
        setattr(cfg.compile, k, v)
    return cfg


def fresh_root(tmp_path: Path, shared_root: Path) -> Path:
    """An empty cache (each entry builds its kernels in its own Inductor cache: nothing to share)."""
    root = tmp_path / "cache"
    root.mkdir()
    return root


def copy_entry(src_root: Path, key: str, dst_root: Path) -> Path:
    shutil.copytree(src_root / key, dst_root / key)
    return dst_root / key


def assert_matches_eager(forward, model, sizes=(1, 2, 7, 33), tol=1e-5):
    gen = torch.Generator().manual_seed(0)
    for t in sizes:
        ids = torch.randint(0, model.arch.vocab_size, (t,), generator=gen)
        pos = torch.arange(t)
        with torch.inference_mode():
            got, want = forward(ids, pos), model(ids, pos)
        assert got.shape == want.shape
        err = (got - want).abs().max().item()
        assert err <= tol, f"batch {t}: max error {err}"
