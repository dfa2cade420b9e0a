"""Signed entries: a MAC under a key outside the cache decides what loads; the pickle scan refuses a
smuggled call even in a correctly signed file; the key is created private and is no key factor."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import stat
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from atomc import env
from atomc.cli.cache import cache_app
from atomc.graphs import artifact, build, cache_key, pickle_scan, signing
from atomc.graphs.artifact import ArtifactError
from atomc.graphs.cache_store import READY, CacheStore, sha256_file
from models.loader import load_model
from tests.graphs.helpers import copy_entry, make_config, signing_key


def _load(llama_dir, cfg):
    model = load_model(llama_dir, torch.float32, "cpu")
    return build.compile_or_load(model, llama_dir, cfg, "cpu", torch.float32)


def _entry_copy(tmp_path, shared_root, key) -> tuple[Path, Path]:
    root = tmp_path / "c"
    root.mkdir()
    return root, copy_entry(shared_root, key, root)


def _reseal(entry_dir: Path, key: signing.SigningKey | None) -> None:
    """Recompute every file's checksum into the manifest, then sign it with `key`, or (None) write
    `.ready` the way someone without the key could: a plain sha256 of the manifest."""
    m = json.loads((entry_dir / "manifest.json").read_text())
    for rel, meta in m["files"].items():
        meta.update(size=(entry_dir / rel).stat().st_size, sha256=sha256_file(entry_dir / rel))
    data = json.dumps(m, indent=2, sort_keys=True).encode()
    (entry_dir / "manifest.json").write_bytes(data)
    (entry_dir / READY).write_text(key.sign(data) if key else hashlib.sha256(data).hexdigest())


def _other_key(tmp_path) -> Path:
    path = tmp_path / "other.key"
    path.write_text("f" * 64)
    path.chmod(0o600)
    return path


def test_entries_are_signed_and_carry_their_kernels(compiled):
    _, res = compiled
    ready = (res.entry_dir / READY).read_text().split()
    assert ready[0] == signing.SCHEME and ready[1] == signing_key().key_id
    kernels = [f for f in res.manifest["files"] if f.startswith("inductor/")]
    assert kernels and all(f.endswith(".so") for f in kernels)  # the CPU kernels a load dlopens
    assert not (res.entry_dir.parent / "inductor").exists()  # no shared Inductor cache any more
    assert CacheStore(res.entry_dir.parent).entry(res.key).verify(signing_key()) == []


def test_tampered_artifact_with_fresh_checksums_is_refused_by_the_mac(tmp_path, shared_root, compiled, llama_dir):
    _, res = compiled
    root, entry = _entry_copy(tmp_path, shared_root, res.key)
    data = bytearray((entry / "model.aot").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (entry / "model.aot").write_bytes(bytes(data))
    _reseal(entry, None)  # every checksum matches; only the key could tell
    cfg = make_config(root, require_artifacts=True)
    with pytest.raises(ArtifactError, match="not signed"):
        _load(llama_dir, cfg)
    # an attacker who copies the key id but cannot compute the MAC
    forged = signing.SigningKey(b"x" * 32, Path("forged"))
    m = (entry / "manifest.json").read_bytes()
    (entry / READY).write_text(f"{signing.SCHEME} {signing_key().key_id} {forged.mac(m)}")
    with pytest.raises(ArtifactError, match="damaged.*does not match its signature"):
        _load(llama_dir, cfg)
    # a kernel swapped for another, its checksum updated: the same
    _reseal(entry, signing_key())
    assert CacheStore(root).entry(res.key).verify(signing_key()) == []  # (resigned with the key: valid)
    so = next(entry.glob("inductor/**/*.so"))
    so.write_bytes(so.read_bytes() + b"\0")
    m = json.loads((entry / "manifest.json").read_text())
    rel = so.relative_to(entry).as_posix()
    m["files"][rel].update(size=so.stat().st_size, sha256=sha256_file(so))
    (entry / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="does not match its signature"):
        _load(llama_dir, cfg)


def test_wrong_key_is_refused_on_a_read_only_cache_and_rebuilt_on_a_writable_one(
    tmp_path, shared_root, compiled, llama_dir, monkeypatch, caplog
):
    _, res = compiled
    root, _ = _entry_copy(tmp_path, shared_root, res.key)
    cfg = make_config(root, cache_signing_key_file=str(_other_key(tmp_path)))
    with monkeypatch.context() as mp:
        mp.setattr(CacheStore, "writable", property(lambda self: False))
        with pytest.raises(ArtifactError, match="signed with another key.*--cache-signing-key-file"):
            _load(llama_dir, cfg)
    assert (root / res.key / "model.aot").exists()  # a read-only entry is not deleted
    # `atomc cache verify` says so too, and exits 1
    other = cfg.compile.cache_signing_key_file
    out = CliRunner().invoke(cache_app, ["verify", "--cache-dir", str(root), "--cache-signing-key-file", other])
    assert out.exit_code == 1 and "signed with key" in out.output
    ok = CliRunner().invoke(cache_app, ["verify", "--cache-dir", str(root)])  # the session's key
    assert ok.exit_code == 0, ok.output
    with caplog.at_level(logging.WARNING, logger="atomc.graphs.build"):
        got = _load(llama_dir, cfg)  # writable: rebuilt under this key, then a hit for it
    assert not got.hit and "signed with another key" in caplog.text
    assert CacheStore(root).entry(res.key).verify(signing.load_key(cfg.compile.cache_signing_key_file)) == []
    assert _load(llama_dir, cfg).hit


def test_unsigned_old_entry_is_rebuilt_and_says_so(tmp_path, shared_root, compiled, llama_dir, caplog, monkeypatch):
    _, res = compiled
    root, entry = _entry_copy(tmp_path, shared_root, res.key)
    _reseal(entry, None)  # what atomc wrote before entries were signed
    with monkeypatch.context() as mp:
        mp.setattr(CacheStore, "writable", property(lambda self: False))
        with pytest.raises(ArtifactError, match="not signed.*atomc compile"):
            _load(llama_dir, make_config(root))
    with caplog.at_level(logging.WARNING, logger="atomc.graphs.build"):
        got = _load(llama_dir, make_config(root))
    assert not got.hit and "not signed" in caplog.text


def test_signed_entry_loads_warm_without_writing(tmp_path, shared_root, compiled, llama_dir, monkeypatch):
    _, res = compiled
    root, _ = _entry_copy(tmp_path, shared_root, res.key)
    before = sorted((p.relative_to(root), p.stat().st_mtime_ns) for p in root.rglob("*"))
    monkeypatch.setattr(CacheStore, "writable", property(lambda self: False))
    spy = []
    monkeypatch.setattr(build, "_build", lambda *a, **k: spy.append(1))
    got = _load(llama_dir, make_config(root))
    assert got.hit and not spy
    assert sorted((p.relative_to(root), p.stat().st_mtime_ns) for p in root.rglob("*")) == before


def _str(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE


def _global(module: str, name: str) -> bytes:
    return _str(module) + _str(name) + b"\x93"  # STACK_GLOBAL


def _call(fn: bytes, *args) -> bytes:
    """A protocol-4 pickle of fn(*args) (args: strings, or opcodes that push a global)."""
    pushed = b"".join(a if isinstance(a, bytes) else _str(a) for a in args)
    return b"\x80\x04" + fn + b"(" + pushed + b"tR."  # MARK ... TUPLE REDUCE STOP


class _Gadget:
    """The classic: unpickling calls os.system."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_smuggled_call_is_refused_before_anything_runs(tmp_path, shared_root, compiled, llama_dir):
    _, res = compiled
    root, entry = _entry_copy(tmp_path, shared_root, res.key)
    marker = tmp_path / "ran"
    (entry / "model.aot").write_bytes(pickle.dumps({"state": _Gadget(marker)}))
    cfg = make_config(root, require_artifacts=True)
    _reseal(entry, signing_key())  # correctly signed (a leaked key): the scan is what stops it
    assert CacheStore(root).entry(res.key).verify(signing_key()) == []
    with pytest.raises(ArtifactError, match="refused.*posix:system"):
        _load(llama_dir, cfg)
    assert not marker.exists()
    _reseal(entry, None)  # and without the key: the signature stops it first
    with pytest.raises(ArtifactError, match="not signed"):
        _load(llama_dir, cfg)
    assert not marker.exists()


def test_scan_admits_real_artifacts_and_refuses_gadgets(compiled, tmp_path):
    _, res = compiled
    names = pickle_scan.artifact_globals((res.entry_dir / "model.aot").read_bytes())
    assert "torch._inductor.output_code:CompiledFxGraph" in names  # found inside the nested pickles
    assert "models.llama:LlamaForCausalLM" in names

    marker = tmp_path / "ran"
    import builtins
    import importlib

    class Call:
        def __init__(self, fn, *args):
            self.fn, self.args = fn, args

        def __reduce__(self):
            return (self.fn, self.args)

    gadgets = [
        _Gadget(marker),
        Call(builtins.eval, "1"),
        Call(builtins.exec, "1"),
        Call(importlib.import_module, "os"),
        {"nested": pickle.dumps(_Gadget(marker))},  # inside a byte string torch would unpickle later
    ]
    for g in gadgets:
        with pytest.raises(pickle_scan.UnsafePickle):
            pickle_scan.scan(pickle.dumps(g, protocol=4))
    hand_made = [
        # torch re-exports os: a dotted name walking from an admitted module
        _call(_global("torch", "os.system"), "x"),
        # getattr on an admitted class, reaching an attribute that is not listed
        _call(_global("builtins", "getattr"), _global("torch._dynamo.package", "SerializedCode"), "__init__"),
        # torch's own import-by-name helper, asked for os
        _call(_global("torch._dynamo.aot_compile", "AOTCompilePickler._unpickle_module"), "os"),
    ]
    for data in hand_made:
        with pytest.raises(pickle_scan.UnsafePickle):
            pickle_scan.scan(data)
    ok = _call(_global("torch._dynamo.aot_compile", "AOTCompilePickler._unpickle_module"), "torch.nn.init")
    assert pickle_scan.scan(ok) == ["torch._dynamo.aot_compile:AOTCompilePickler._unpickle_module"]
    assert not marker.exists()


def _expr(fn: bytes, *args) -> bytes:
    """fn(*args) as an argument inside another call (no protocol header, no STOP)."""
    return _call(fn, *args)[2:-1]


_IMPORT_BY_NAME = _global("torch._dynamo.aot_compile", "AOTCompilePickler._unpickle_module")
_GETATTR = _global("builtins", "getattr")


def test_getattr_on_an_imported_module_reaches_only_submodules_and_admitted_classes():
    # a submodule, and an admitted class reached through a package that re-exports it
    sub = _call(_GETATTR, _expr(_IMPORT_BY_NAME, "torch.nn"), "functional")
    assert pickle_scan.scan(sub) == ["builtins:getattr", "torch._dynamo.aot_compile:AOTCompilePickler._unpickle_module"]
    cls = _call(_GETATTR, _expr(_IMPORT_BY_NAME, "torch.nn"), "ModuleList")
    assert "torch.nn.modules.container:ModuleList" in pickle_scan.scan(cls)
    refused = {
        "a function": (
            _call(_GETATTR, _expr(_GETATTR, _expr(_IMPORT_BY_NAME, "torch.nn"), "init"), "normal_"),
            "function",
        ),
        "os re-exported": (_call(_GETATTR, _expr(_IMPORT_BY_NAME, "torch._dynamo.utils"), "os"), "'os'"),
        "a dunder": (_call(_GETATTR, _expr(_IMPORT_BY_NAME, "torch"), "__builtins__"), "__builtins__"),
        "a class not listed": (_call(_GETATTR, _expr(_IMPORT_BY_NAME, "torch.nn"), "Linear"), "Linear"),
    }
    for what, (data, named) in refused.items():
        with pytest.raises(pickle_scan.UnsafePickle, match=named):
            pickle_scan.scan(data)
        assert pickle_scan.audit(data)[1], what


def test_getattr_on_a_built_object_reaches_only_listed_methods():
    # pickle's spelling of a bound method: getattr(the object, name); Triton's JIT functions carry one
    jit = _expr(_global("triton.runtime.jit", "JITFunction"))
    assert "triton.runtime.jit:JITFunction.create_binder" in pickle_scan.scan(_call(_GETATTR, jit, "create_binder"))
    with pytest.raises(pickle_scan.UnsafePickle, match="a method the allow-list does not admit"):
        pickle_scan.scan(_call(_GETATTR, jit, "run"))


def test_audit_collects_every_refusal_instead_of_stopping():
    data = b"\x80\x04" + _global("posix", "system") + _expr(_IMPORT_BY_NAME, "os") + b"\x86."  # TUPLE2
    with pytest.raises(pickle_scan.UnsafePickle, match="posix:system"):
        pickle_scan.scan(data)
    names, refusals = pickle_scan.audit(data)
    assert names == ["torch._dynamo.aot_compile:AOTCompilePickler._unpickle_module"]  # the admitted ones
    assert len(refusals) == 2 and "posix:system" in refusals[0] and "'os'" in refusals[1]


def test_key_is_created_private_on_first_use(tmp_path, monkeypatch):
    monkeypatch.delenv("ATOMC_CACHE_SIGNING_KEY_FILE", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    old = os.umask(0)  # whatever the umask
    try:
        key = signing.load_key()
    finally:
        os.umask(old)
    path = tmp_path / "cfg" / "atomc" / env.SIGNING_KEY_NAME
    assert key.path == path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert signing.load_key().secret == key.secret  # created once, then read
    with pytest.raises(signing.SigningKeyError, match="no compile cache signing key"):
        signing.load_key(tmp_path / "missing", create=False)
    path.chmod(0o620)
    with pytest.raises(signing.SigningKeyError, match="writable by group or others"):
        signing.load_key()
    short = tmp_path / "short"
    short.write_text("abc")
    with pytest.raises(signing.SigningKeyError, match="at least 32"):
        signing.load_key(short)


def test_where_the_key_lives_is_no_key_factor(monkeypatch, tmp_path):
    monkeypatch.setenv("ATOMC_CACHE_SIGNING_KEY_FILE", str(tmp_path / "k"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert "ATOMC_CACHE_SIGNING_KEY_FILE" in env.snapshot()
    snap = env.graph_snapshot()
    assert "ATOMC_CACHE_SIGNING_KEY_FILE" not in snap and "XDG_CONFIG_HOME" not in snap
    assert signing.key_path(None) == tmp_path / "k"
    assert signing.key_path("~/x") == Path("~/x").expanduser()  # the config field / flag wins


def test_scan_enforces_on_checked_platforms_and_reports_elsewhere(tmp_path, caplog):
    # getattr on an object the pickle built, a method not listed: refused on CPU and CUDA, whose
    # artifacts the allow-list was checked against; on ROCm (never checked) the finding is logged
    data = _call(_global("builtins", "getattr"), _call(_global("torch._dynamo.package", "SerializedCode"))[2:-1], "x")
    (tmp_path / "model.aot").write_bytes(data)
    with pytest.raises(ArtifactError, match=r"refused: .*getattr\(an instance of torch._dynamo.package:SerializedCode"):
        artifact.load_aot(tmp_path, "cpu")
    assert "cuda" in pickle_scan.ENFORCED_PLATFORMS and "rocm" not in pickle_scan.ENFORCED_PLATFORMS
    with pytest.raises(ArtifactError, match="refused"):
        artifact.load_aot(tmp_path, "cuda")
    with caplog.at_level("WARNING", logger="atomc.graphs.artifact"):
        # torch then reads it (and fails: it is no artifact)
        with pytest.raises(ArtifactError, match="could not be loaded"):
            artifact.load_aot(tmp_path, "rocm")
    assert "would refuse this rocm artifact" in caplog.text and "SerializedCode" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_artifact_loads_warm_and_what_the_scan_says(tmp_path, llama_dir, caplog):
    """A real CUDA artifact loads again from the cache (a hit), the scan enforced on it, and its audit
    finds nothing the allow-list refuses."""
    cfg = make_config(tmp_path / "cache")
    cfg.device = "cuda"
    model = load_model(llama_dir, torch.bfloat16, "cuda")
    first = build.compile_or_load(model, llama_dir, cfg, "cuda", torch.bfloat16)
    with caplog.at_level("WARNING"):
        again = build.compile_or_load(model, llama_dir, cfg, "cuda", torch.bfloat16)
    if not again.hit:
        rows = cache_key.diff(
            cache_key.flatten(first.manifest.get("factors", {})), cache_key.flatten(again.manifest.get("factors", {}))
        )
        pytest.fail(
            f"the second load was a miss (keys {first.key}, {again.key}); factors that differ:\n"
            f"{cache_key.format_diff(rows)}\nwarnings: {caplog.text[-3000:]}"
        )
    data = (first.entry_dir / "model.aot").read_bytes()
    names, refusals = pickle_scan.audit(data)  # the load above already enforced it; this names them all
    assert not refusals and "torch._inductor.output_code:CompiledFxGraph" in names
