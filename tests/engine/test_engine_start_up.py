"""Start-up of the engine process's client: the server side's tokenizer loads once, on a thread,
while the engine process starts; a folder known only after the engine resolves it loads then."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import atomc.engine.tokenizer as tokenizer_mod
from atomc.config import EngineConfig
from atomc.engine.process import EarlyTokenizer, early_tokenizer_dir


@pytest.fixture
def loads(monkeypatch):
    calls: list[tuple[Path, str]] = []

    def fake_load(path):
        calls.append((Path(path), threading.current_thread().name))
        return f"tok:{Path(path).name}"

    monkeypatch.setattr(tokenizer_mod, "load_tokenizer", fake_load)
    return calls


def test_early_dir_is_the_model_folder_or_the_tokenizer_flag(tmp_path):
    cfg = EngineConfig()
    assert early_tokenizer_dir(cfg) is None  # the default model: resolved in the engine process
    cfg.model.model = str(tmp_path / "model.gguf")
    assert early_tokenizer_dir(cfg) is None  # converted in the engine process
    (tmp_path / "config.json").write_text("{}")
    cfg.model.model = str(tmp_path)
    assert early_tokenizer_dir(cfg) == tmp_path.resolve()
    cfg.model.tokenizer = str(tmp_path / "tok")
    assert early_tokenizer_dir(cfg) == (tmp_path / "tok").resolve()


def test_the_early_tokenizer_is_loaded_once_on_its_thread(tmp_path, loads):
    early = EarlyTokenizer(tmp_path)
    assert early.result(tmp_path) == f"tok:{tmp_path.name}"
    assert loads == [(tmp_path, "atomc-tokenizer")]  # one load, off the caller's thread


def test_another_folder_from_the_engine_is_loaded_then(tmp_path, loads):
    other = tmp_path / "converted"
    early = EarlyTokenizer(tmp_path)
    assert early.result(other) == "tok:converted"
    assert [p for p, _ in loads] == [tmp_path, other]


def test_no_early_folder_loads_after_the_engine(tmp_path, loads):
    assert EarlyTokenizer(None).result(tmp_path) == f"tok:{tmp_path.name}"
    assert loads == [(tmp_path, threading.current_thread().name)]


def test_a_failed_early_load_is_retried_where_its_error_is_raised(tmp_path, monkeypatch):
    def broken(path):
        raise FileNotFoundError(f"{path} has no tokenizer.json or tokenizer_config.json")

    monkeypatch.setattr(tokenizer_mod, "load_tokenizer", broken)
    early = EarlyTokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        early.result(tmp_path)
