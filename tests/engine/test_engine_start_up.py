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


class _Runner:
    def __init__(self, compile_info, timings):
        self.compile_info, self.timings = compile_info, timings


def test_runner_phases_split_a_warm_load_and_show_the_overlapped_cuda_context():
    from atomc.engine.start_up import runner_phases

    times = {
        "imports_s": 3.04, "device_init_s": 0.81, "device_init_wait_s": 0.0, "load_weights_s": 1.2,
        "compile_or_load_s": 4.7, "kv_sizing_s": 0.4,
    }  # fmt: skip
    line = runner_phases(_Runner({"hit": True, "timings": {"load_s": 4.1}}, times))
    assert line.startswith("imports 3.0s (backend ops, compiler), weights 1.2s (CUDA context 0.8s on a thread")
    assert "0.0s waited)" in line
    assert "model (artifact loaded) 4.7s (cache key and checks 0.6s, load 4.1s)" in line
    assert line.endswith("the kernels' first-use compiles)") and "KV sizing 0.4s" in line
    # a CPU start (no thread) and a cold one: no context figure, no split
    cold = runner_phases(_Runner({"hit": False, "timings": {}}, {**times, "device_init_s": 0.0}))
    assert "CUDA context" not in cold and "model (compiled) 4.7s," in cold
    assert "model (eager) 0.0s" in runner_phases(_Runner({}, {}))
    # on a GPU: the forwards at the smaller prefill sizes, after the sizing forward
    gpu = runner_phases(_Runner({"hit": True, "timings": {"load_s": 4.1}}, {**times, "warm_up_s": 2.26}))
    assert gpu.endswith("KV sizing 0.4s (on a GPU the first forward, with the kernels' first-use compiles), "
                        "forwards at the smaller prefill sizes 2.3s (their kernels' compiles)")  # fmt: skip
