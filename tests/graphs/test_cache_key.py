"""The key moves with every factor that changes the graph, and not with the weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from atomc.graphs import cache_key as ck
from atomc.graphs.partition import default_capture_sizes, resolve_capture_sizes, splitting_ops
from tests.graphs.helpers import make_config

PASSES = [("canonicalize", "u1"), ("fuse_add_rmsnorm", "u2")]


def key_for(model_dir, cfg=None, dtype=torch.float32, passes=PASSES, sizes=(1, 2, 4), fmt="aot_fn", device="cpu"):
    cfg = cfg or make_config("/unused")
    f = ck.collect_factors(
        model_dir,
        cfg,
        device,
        dtype,
        passes,
        splitting_ops=splitting_ops(),
        capture_sizes=list(sizes),
        artifact_format=fmt,
    )
    return ck.cache_key(f), f


def test_key_is_stable(llama_dir):
    assert key_for(llama_dir)[0] == key_for(llama_dir)[0]


def test_key_changes_with_each_factor(llama_dir, tmp_path, monkeypatch):
    base, _ = key_for(llama_dir)
    changed = {
        "dtype": key_for(llama_dir, dtype=torch.bfloat16)[0],
        "pass uuid": key_for(llama_dir, passes=[("canonicalize", "u1"), ("fuse_add_rmsnorm", "u3")])[0],
        "pass list": key_for(llama_dir, passes=PASSES[:1])[0],
        "capture sizes": key_for(llama_dir, sizes=(1, 2, 4, 8))[0],
        "format": key_for(llama_dir, fmt="pieces")[0],
    }
    for field, value in [("max_num_batched_tokens", 4096)]:
        cfg = make_config("/unused")
        setattr(cfg.scheduler, field, value)
        changed[field] = key_for(llama_dir, cfg)[0]
    cfg = make_config("/unused")
    cfg.cache.kv_cache_dtype = "float16"
    changed["kv dtype"] = key_for(llama_dir, cfg)[0]
    cfg = make_config("/unused")
    cfg.parallel.tensor_parallel_size, cfg.parallel.rank = 2, 1
    changed["tp"] = key_for(llama_dir, cfg)[0]
    # a different config.json
    other = tmp_path / "other"
    shutil.copytree(llama_dir, other)
    cfg_json = json.loads((other / "config.json").read_text())
    cfg_json["rms_norm_eps"] = 1e-5
    (other / "config.json").write_text(json.dumps(cfg_json))
    changed["config.json"] = key_for(other)[0]
    with monkeypatch.context() as m:
        m.setattr(torch, "__version__", "9.9.9")
        changed["torch version"] = key_for(llama_dir)[0]
    with monkeypatch.context() as m:
        m.setattr(ck, "_cached_source_digest", lambda: "edited")
        changed["atomc sources"] = key_for(llama_dir)[0]
    with monkeypatch.context() as m:
        m.setenv("ATOMC_CACHE_DIR", str(tmp_path / "elsewhere"))
        changed["atomc env var"] = key_for(llama_dir)[0]
    with monkeypatch.context() as m:
        m.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")
        changed["inductor env var"] = key_for(llama_dir)[0]
    same = [name for name, k in changed.items() if k == base]
    assert not same, f"key ignores: {same}"
    assert len(set(changed.values())) == len(changed)


def test_key_ignores_weights_and_json_formatting(llama_dir, tmp_path):
    other = tmp_path / "reweighted"
    shutil.copytree(llama_dir, other)
    weights = load_file(other / "model.safetensors")
    save_file({k: torch.randn_like(v) for k, v in weights.items()}, other / "model.safetensors")
    (other / "config.json").write_text(json.dumps(json.loads((other / "config.json").read_text()), indent=7))
    assert key_for(other)[0] == key_for(llama_dir)[0]


def test_source_digest_tracks_edits(tmp_path):
    (tmp_path / "models").mkdir()
    src = tmp_path / "models" / "m.py"
    src.write_text("x = 1\n")
    before = ck.source_digest(tmp_path, dirs=("models",), files=())
    src.write_text("x = 2\n")
    assert ck.source_digest(tmp_path, dirs=("models",), files=()) != before
    assert len(ck.source_digest()) == 64  # the real tree hashes


def test_diff_and_nearest():
    a = {"dtype": "float32", "model_config": {"hidden_size": 64, "vocab_size": 10}, "passes": [["p", "1"]]}
    b = {"dtype": "float32", "model_config": {"hidden_size": 128, "vocab_size": 10}, "passes": [["p", "2"]]}
    rows = ck.diff(a, b)
    assert [r[0] for r in rows] == ["model_config.hidden_size", "passes"]
    key, d = ck.nearest(a, {"k1": b, "k2": {**a, "dtype": "bfloat16"}})
    assert key == "k2" and [r[0] for r in d] == ["dtype"]


def test_capture_sizes():
    assert default_capture_sizes(256, 8192)[:5] == [1, 2, 4, 8, 16]
    assert default_capture_sizes(256, 8192)[-1] == 256
    assert default_capture_sizes(3, 8192) == [1, 2, 3]
    assert resolve_capture_sizes([8, 1, 8], 256, 8192) == [1, 8]
    with pytest.raises(ValueError):
        resolve_capture_sizes([0], 256, 8192)
