"""Damaged, unfinished and concurrent builds: never a bad load, never a half entry, one build per key."""

from __future__ import annotations

import threading

import pytest
import torch

from atomc.graphs import build
from atomc.graphs.artifact import ArtifactError
from atomc.graphs.cache_store import CacheStore
from models.loader import load_model
from tests.graphs.helpers import assert_matches_eager, copy_entry, fresh_root, make_config, signing_key


def _load(llama_dir, cfg, **kw):
    model = load_model(llama_dir, torch.float32, "cpu")
    return build.compile_or_load(model, llama_dir, cfg, "cpu", torch.float32, **kw)


def test_killed_compile_then_damage_then_rebuild(tmp_path, shared_root, compiled, llama_dir):
    root = fresh_root(tmp_path, shared_root)
    cfg = make_config(root)
    store = CacheStore(root)

    # a compile that dies after writing its artifact but before committing leaves no ready entry
    def killed(*args, **kwargs):
        raise RuntimeError("injected failure before commit")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CacheStore, "commit", killed)
        with pytest.raises(RuntimeError, match="injected"):
            _load(llama_dir, cfg)
    (key,) = store.keys()
    assert (root / key / "model.aot").is_file() and not store.entry(key).ready
    assert store.entry(key).verify(signing_key())  # reported as unfinished
    res = _load(llama_dir, cfg)  # the next compile succeeds, over the leftovers
    assert not res.hit and res.key == key and store.entry(key).verify(signing_key()) == []

    art = root / key / "model.aot"
    data = bytearray(art.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    art.write_bytes(bytes(data))
    assert any("checksum" in p for p in store.entry(key).verify(signing_key()))
    cfg.compile.require_artifacts = True
    with pytest.raises(ArtifactError, match="damaged"):  # refused, with a clear error
        _load(llama_dir, cfg)

    art.write_bytes(bytes(data[:100]))  # truncated
    assert any("truncated" in p for p in store.entry(key).verify(signing_key()))
    cfg.compile.require_artifacts = False
    res = _load(llama_dir, cfg)  # without --require-artifacts: dropped and rebuilt, never loaded
    assert not res.hit and store.entry(key).verify(signing_key()) == []
    assert_matches_eager(res.forward, load_model(llama_dir, torch.float32, "cpu"), sizes=(1, 5))


def test_concurrent_compiles_build_once(tmp_path, shared_root, compiled, llama_dir, monkeypatch):
    root = fresh_root(tmp_path, shared_root)
    cfg = make_config(root)
    builds = []
    real_build = build._build

    def counting_build(*a, **kw):
        builds.append(threading.get_ident())
        return real_build(*a, **kw)

    monkeypatch.setattr(build, "_build", counting_build)
    models = [load_model(llama_dir, torch.float32, "cpu") for _ in range(2)]
    results, errors = [None, None], []

    def run(i):
        try:
            results[i] = build.compile_or_load(models[i], llama_dir, cfg, "cpu", torch.float32)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(builds) == 1
    assert sorted(r.hit for r in results) == [False, True]
    assert results[0].key == results[1].key


def test_require_artifacts_miss_lists_differing_factors(tmp_path, shared_root, compiled, llama_dir):
    _, res = compiled
    root = tmp_path / "cache"
    root.mkdir()
    copy_entry(shared_root, res.key, root)
    cfg = make_config(root, require_artifacts=True, disabled_passes=["decode_gemv"])
    cfg.model.dtype = "bfloat16"
    with pytest.raises(build.ArtifactsMissing) as info:
        model = load_model(llama_dir, torch.bfloat16, "cpu")
        build.compile_or_load(model, llama_dir, cfg, "cpu", torch.bfloat16)
    msg = str(info.value)
    assert res.key in msg and "passes" in msg and "dtype" in msg
    assert "model_config" not in msg  # only what differs
