"""The compile cache as a trust boundary: private modes whatever the umask, foreign or shared-writable
entries refused, a read-only cache loads without writing, and a manifest that is valid JSON but wrong
is a damaged entry (rebuilt), never a traceback."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from atomc.graphs import build
from atomc.graphs.artifact import ArtifactError
from atomc.graphs.cache_store import CacheStore, make_private_dir, manifest_problems
from models.loader import load_model
from tests.graphs.helpers import copy_entry, make_config, signing_key


def _load(llama_dir, cfg, **kw):
    model = load_model(llama_dir, torch.float32, "cpu")
    return build.compile_or_load(model, llama_dir, cfg, "cpu", torch.float32, **kw)


def _modes(root):
    return {p: stat.S_IMODE(p.lstat().st_mode) for p in [root, *root.rglob("*")] if not p.is_symlink()}


def test_entries_are_private_whatever_the_umask(compiled):
    _, res = compiled  # built under the test process's umask (022 by default: files would be 0644)
    for p, mode in _modes(res.entry_dir).items():
        assert mode == (0o700 if p.is_dir() else 0o600), (p, oct(mode))


def test_private_dirs_ignore_the_umask(tmp_path):
    old = os.umask(0)
    try:
        make_private_dir(tmp_path / "a" / "b")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "a" / "b").stat().st_mode) == 0o700


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX ownership")
def test_entries_others_could_write_are_refused(tmp_path, shared_root, compiled, llama_dir):
    _, res = compiled
    root = tmp_path / "c"
    root.mkdir()
    entry = copy_entry(shared_root, res.key, root)
    cfg = make_config(root)
    os.chmod(entry / "model.aot", 0o666)
    with pytest.raises(ArtifactError, match="not trusted.*model.aot is writable by group or others"):
        _load(llama_dir, cfg)
    os.chmod(entry / "model.aot", 0o600)
    if os.getuid() == 0:  # root can hand the file to someone else: an entry another user wrote
        os.chown(entry / "model.aot", 12345, -1)
        with pytest.raises(ArtifactError, match="owned by uid 12345"):
            _load(llama_dir, cfg)
        os.chown(entry / "model.aot", 0, -1)
    assert _load(llama_dir, cfg).hit


def test_read_only_cache_loads_and_writes_nothing(tmp_path, shared_root, compiled, llama_dir, monkeypatch):
    _, res = compiled
    root = tmp_path / "ro"
    root.mkdir()
    copy_entry(shared_root, res.key, root)
    before = sorted((p.relative_to(root), p.stat().st_mtime_ns) for p in root.rglob("*"))
    # tests run as root here, which os.access never refuses: say read-only the way a mount would
    monkeypatch.setattr(CacheStore, "writable", property(lambda self: False))
    got = _load(llama_dir, make_config(root))
    assert got.hit
    after = sorted((p.relative_to(root), p.stat().st_mtime_ns) for p in root.rglob("*"))
    assert after == before  # no lock file, no Inductor scratch, nothing removed
    # a miss on a read-only cache is one clear error, not a half-written entry
    with pytest.raises(build.ArtifactsMissing, match="read-only"):
        _load(llama_dir, make_config(root, disabled_passes=["decode_gemv"]))  # another key
    # and a damaged entry there is reported, not deleted
    (root / res.key / "model.aot").write_bytes(b"junk")
    with pytest.raises(ArtifactError, match="damaged"):
        _load(llama_dir, make_config(root))
    assert (root / res.key / "model.aot").exists()


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.pop("files"),
        lambda m: m.pop("format"),
        lambda m: m.update(format="pickle"),
        lambda m: m["factors"].pop("system"),
        lambda m: m.update(files={"../../etc/passwd": {"size": 1, "sha256": "0" * 64}}),
        lambda m: m.update(files={"model.aot": {"size": "big"}}),
        lambda m: m.update(files=[]),
        lambda m: m.update(key="0" * 24),  # another entry's manifest, moved into this folder
    ],
)
def test_wrong_manifest_is_rebuilt_not_a_traceback(tmp_path, shared_root, compiled, llama_dir, edit, request):
    _, res = compiled
    root = tmp_path / "c"
    root.mkdir()
    entry_dir = copy_entry(shared_root, res.key, root)
    m = json.loads((entry_dir / "manifest.json").read_text())
    edit(m)
    assert manifest_problems(m) or m["key"] != res.key
    # resealed with a valid signature: only the schema check can tell
    CacheStore.write_manifest(CacheStore(root).entry(res.key), m, signing_key())
    assert CacheStore(root).entry(res.key).verify(signing_key())
    with pytest.raises(ArtifactError, match="damaged"):  # a clear refusal, not a traceback
        _load(llama_dir, make_config(root, require_artifacts=True))
    if request.node.callspec.indices["edit"] == 0:  # and without --require-artifacts a rebuild (one
        got = _load(llama_dir, make_config(root))  # case: each rebuild compiles its kernels afresh)
        assert not got.hit and CacheStore(root).entry(res.key).verify(signing_key()) == []


def test_edited_manifest_fails_its_signature(tmp_path, shared_root, compiled):
    _, res = compiled
    root = tmp_path / "c"
    root.mkdir()
    entry_dir = copy_entry(shared_root, res.key, root)
    m = json.loads((entry_dir / "manifest.json").read_text())
    m["factors"]["dtype"] = "float16"  # still a valid manifest, but not the one that was sealed
    (entry_dir / "manifest.json").write_text(json.dumps(m))
    assert any("signature" in p for p in CacheStore(root).entry(res.key).verify(signing_key()))
