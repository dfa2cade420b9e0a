"""`atomc cache ...` through typer's CliRunner, and `compile_command` on a hit."""

from __future__ import annotations

import json
import os
import shutil
import time

from typer.testing import CliRunner

from atomc.cli.cache import cache_app, compile_command
from atomc.graphs.cache_store import CacheStore
from tests.graphs.helpers import copy_entry, make_config, signing_key

runner = CliRunner()


def invoke(*args):
    return runner.invoke(cache_app, [str(a) for a in args])


def _second_entry(root, key, new_key="f" * 24, **factor_changes):
    """A copy of an entry under another key with some factors changed (for diff/nearest)."""
    dst = root / new_key
    shutil.copytree(root / key, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["key"] = new_key
    m["factors"].update(factor_changes)
    CacheStore.write_manifest(CacheStore(root).entry(new_key), m, signing_key())  # resealed: a valid entry
    return new_key


def test_ls_show_diff_verify(tmp_path, shared_root, compiled):
    _, res = compiled
    root = tmp_path / "c"
    root.mkdir()
    copy_entry(shared_root, res.key, root)
    other = _second_entry(root, res.key, dtype="bfloat16")

    out = invoke("ls", "--cache-dir", root)
    assert out.exit_code == 0 and res.key in out.output and "LlamaForCausalLM L2 H64" in out.output
    rows = json.loads(invoke("ls", "--cache-dir", root, "--json").output)["entries"]
    assert {r["key"] for r in rows} == {res.key, other} and all(r["ready"] for r in rows)

    out = invoke("show", res.key[:8], "--cache-dir", root)
    assert out.exit_code == 0 and "partitions" in out.output and "model_config" in out.output
    assert json.loads(invoke("show", res.key, "--cache-dir", root, "--json").output)["key"] == res.key
    out = invoke("show", res.key, "--graph", "before", "--cache-dir", root)
    assert out.exit_code == 0 and "def forward" in out.output and "atomc.attention" in out.output
    for p in res.manifest["passes"]:
        assert invoke("show", res.key, "--graph", p["name"], "--cache-dir", root).exit_code == 0
    assert invoke("show", res.key, "--graph", "no_such_pass", "--cache-dir", root).exit_code == 2
    assert invoke("show", "zzz", "--cache-dir", root).exit_code == 2

    out = invoke("diff", res.key, other, "--cache-dir", root)
    assert out.exit_code == 0 and "dtype" in out.output and "float32" in out.output
    assert "passes" not in out.output

    assert invoke("verify", "--cache-dir", root).exit_code == 0
    (root / other / "model.aot").write_bytes(b"junk")
    out = invoke("verify", "--cache-dir", root)
    assert out.exit_code == 1 and "BAD" in out.output and "ok" in out.output


def test_explain_hit_and_miss(shared_root, compiled, llama_dir, monkeypatch):
    args = ["explain", "--model", llama_dir, "--device", "cpu"]
    out = invoke(*args, "--cache-dir", shared_root)
    assert out.exit_code == 0 and out.output.startswith("hit:"), out.output
    # the cache named by the environment instead of the flag is the same cache: a hit
    monkeypatch.setenv("ATOMC_CACHE_DIR", str(shared_root))
    out = invoke(*args)
    assert out.exit_code == 0 and out.output.startswith("hit:"), out.output
    out = invoke(*args, "--disable-pass", "fuse_silu_mul")
    assert out.exit_code == 1 and "miss" in out.output and "passes" in out.output


def test_explain_names_the_edited_source_file(tmp_path, shared_root, compiled, llama_dir):
    """An entry built from other text of one file: explain names that file."""
    _, res = compiled
    root = tmp_path / "c"
    root.mkdir()
    copy_entry(shared_root, res.key, root)
    sources = dict(res.manifest["factors"]["sources"], **{"models/layers/norm.py": "0" * 20})
    _second_entry(root, res.key, sources=sources)
    shutil.rmtree(root / res.key)  # only the edited entry is left: a miss
    out = invoke("explain", "--model", llama_dir, "--device", "cpu", "--cache-dir", root)
    assert out.exit_code == 1 and "differs in 1 factor" in out.output, out.output
    assert "sources.models/layers/norm.py" in out.output


def test_clear(tmp_path, shared_root, compiled):
    _, res = compiled
    root = tmp_path / "c"
    root.mkdir()
    copy_entry(shared_root, res.key, root)
    other = _second_entry(root, res.key, dtype="bfloat16")
    assert invoke("clear", "--cache-dir", root).exit_code == 2  # needs exactly one selector
    assert invoke("clear", other, "--cache-dir", root).exit_code == 0
    assert not (root / other).exists() and (root / res.key).exists()
    m = json.loads((root / res.key / "manifest.json").read_text())
    m["created"] = time.time() - 3 * 86400
    (root / res.key / "manifest.json").write_text(json.dumps(m))
    assert "removed 0" in invoke("clear", "--older-than", 5, "--cache-dir", root).output
    assert "removed 1" in invoke("clear", "--older-than", 2, "--cache-dir", root).output
    copy_entry(shared_root, res.key, root)
    (root / "inductor").mkdir()  # the shared Inductor cache of older versions goes too
    assert invoke("clear", "--all", "--cache-dir", root).exit_code == 0
    assert sorted(os.listdir(root)) == ["locks"]


def test_compile_command_reports_a_hit(shared_root, compiled, llama_dir, capsys):
    cfg = make_config(shared_root)
    cfg.model.model = str(llama_dir)
    assert compile_command(cfg, as_json=True) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["hit"] and report["key"] == compiled[1].key and "passes" in report and "partitions" in report
    assert compile_command(cfg, as_json=False) == 0
    text = capsys.readouterr().out
    assert "cache hit" in text and "flops" in text and "partitions" in text


def _converted_model(root, name="SmolLM2-135M-Instruct-Q8_0-0123456789abcdef", complete=True):
    from models.loader.gguf import MARKER

    d = root / "models" / name
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"\0" * 2048)
    if complete:
        (d / MARKER).write_text("")
    return d


def test_converted_models_are_not_compile_entries(tmp_path, shared_root, compiled):
    # a fresh install holds one converted model and no compile entry: verify must pass
    root = tmp_path / "fresh"
    model = _converted_model(root)
    out = invoke("verify", "--cache-dir", root)
    assert out.exit_code == 0, out.output
    assert f"models/{model.name}  ok" in out.output
    out = invoke("ls", "--cache-dir", root)
    assert out.exit_code == 0 and "no compile entries" in out.output and model.name in out.output
    listing = json.loads(invoke("ls", "--cache-dir", root, "--json").output)
    assert listing["entries"] == [] and listing["models"][0]["name"] == model.name
    assert listing["models"][0]["size_bytes"] >= 2048
    for args in (["show", "models"], ["diff", "models", "models"], ["show", model.name]):
        out = invoke(*args, "--cache-dir", root)
        assert out.exit_code == 2, out.output
        assert "converted model" in out.output
    # with a compile entry beside it, clearing entries keeps the model; --model removes it
    _, res = compiled
    copy_entry(shared_root, res.key, root)
    assert invoke("clear", "--all", "--cache-dir", root).exit_code == 0
    assert model.is_dir() and not (root / res.key).exists()
    _converted_model(root, "half-done", complete=False)
    out = invoke("verify", "--cache-dir", root)
    assert out.exit_code == 1 and "models/half-done  BAD" in out.output
    assert invoke("clear", "--model", "nope", "--cache-dir", root).exit_code == 2
    assert "removed 2 converted models" in invoke("clear", "--model", "all", "--cache-dir", root).output
    assert not (root / "models").exists() or not any((root / "models").iterdir())


def test_malformed_manifest_is_an_error_line_not_a_traceback(tmp_path, shared_root, compiled):
    _, res = compiled
    root = tmp_path / "c"
    root.mkdir()
    entry = copy_entry(shared_root, res.key, root)
    (entry / "manifest.json").write_text('{"format": "aot_fn"}')
    for args in (["show", res.key], ["diff", res.key, res.key]):
        out = invoke(*args, "--cache-dir", root)
        assert out.exit_code == 1 and isinstance(out.exception, SystemExit), out.output
        assert "not valid" in out.output
    out = invoke("verify", "--cache-dir", root)
    assert out.exit_code == 1 and "BAD" in out.output
    assert invoke("ls", "--cache-dir", root).exit_code == 0
