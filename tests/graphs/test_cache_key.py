"""The key moves with every factor that changes the graph, and not with the weights, the batch
limits, the CUDA-graph sizes or the cache's location."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file

from atomc.graphs import build, sources
from atomc.graphs import cache_key as ck
from atomc.graphs.partition import splitting_ops
from atomc.passes import PassManager
from models.loader import load_model
from tests.graphs.helpers import make_config

PASSES = [("canonicalize", "u1"), ("fuse_add_rmsnorm", "u2")]
SOURCES = {"models/llama.py": "d1", "atomc/ops/rope.py": "d2"}


def key_for(model_dir, cfg=None, dtype=torch.float32, passes=PASSES, fmt="aot_fn", device="cpu", files=SOURCES):
    cfg = cfg or make_config("/unused")
    f = ck.collect_factors(
        model_dir, cfg, device, dtype, passes, source_files=files, splitting_ops=splitting_ops(), artifact_format=fmt
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
        "format": key_for(llama_dir, fmt="pieces")[0],
        "a source file": key_for(llama_dir, files={**SOURCES, "models/llama.py": "d3"})[0],
    }
    cfg = make_config("/unused")
    cfg.cache.kv_cache_dtype = "float16"
    changed["kv dtype"] = key_for(llama_dir, cfg)[0]
    cfg.cache.kv_cache_dtype = "fp8"
    changed["fp8 kv"] = key_for(llama_dir, cfg)[0]
    cfg.cache.kv_cache_dtype = "fp8_e4m3"  # vLLM's other spelling of the same pages: the same key
    assert key_for(llama_dir, cfg)[0] == changed["fp8 kv"]
    cfg = make_config("/unused")
    cfg.parallel.tensor_parallel_size, cfg.parallel.rank = 2, 1
    changed["tp"] = key_for(llama_dir, cfg)[0]
    cfg.parallel.enable_expert_parallel = True  # whole experts a rank: other weight shapes, same sizes
    changed["ep"] = key_for(llama_dir, cfg)[0]
    for stage in (0, 1):  # a pipeline stage's layers (and whether it starts from ids) shape its graph
        cfg = make_config("/unused")
        cfg.parallel.pipeline_parallel_size, cfg.parallel.rank = 2, stage
        changed[f"pp stage {stage}"] = key_for(llama_dir, cfg)[0]
        assert key_for(llama_dir, cfg)[1]["tp_rank"] == 0  # a stage's rank is no tensor-parallel rank
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
        m.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")
        changed["inductor env var"] = key_for(llama_dir)[0]
    same = [name for name, k in changed.items() if k == base]
    assert not same, f"key ignores: {same}"
    assert len(set(changed.values())) == len(changed)


def test_runtime_only_settings_are_not_factors(llama_dir, tmp_path, monkeypatch):
    """Batch limits, capture sizes, the cache's and the signing key's locations shape no graph: same key."""
    base, factors = key_for(llama_dir)
    cfg = make_config(
        tmp_path / "elsewhere", cudagraph_capture_sizes=[1, 2, 3], cache_signing_key_file=str(tmp_path / "k")
    )
    cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_num_seqs = 4096, 64
    assert key_for(llama_dir, cfg)[0] == base
    monkeypatch.setenv("ATOMC_CACHE_DIR", str(tmp_path / "env_cache"))
    monkeypatch.setenv("ATOMC_CACHE_SIGNING_KEY_FILE", str(tmp_path / "env_key"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    # Inductor sets these itself at its first Triton compile: a process's second key must not move
    monkeypatch.setenv("TRITON_PTXAS_PATH", str(tmp_path / "ptxas"))
    monkeypatch.setenv("TRITON_LIBDEVICE_PATH", str(tmp_path / "libdevice.bc"))
    assert key_for(llama_dir)[0] == base
    flat = ck.flatten(factors)
    assert not any("capture" in k or "max_num" in k or "CACHE_DIR" in k or "KEY_FILE" in k for k in flat), sorted(flat)


def test_key_ignores_weights_and_json_formatting(llama_dir, tmp_path):
    other = tmp_path / "reweighted"
    shutil.copytree(llama_dir, other)
    weights = load_file(other / "model.safetensors")
    save_file({k: torch.randn_like(v) for k, v in weights.items()}, other / "model.safetensors")
    (other / "config.json").write_text(json.dumps(json.loads((other / "config.json").read_text()), indent=7))
    assert key_for(other)[0] == key_for(llama_dir)[0]


def _project_copy(tmp_path):
    """The project's packages copied, so a test may add and edit files without touching the tree."""
    root = tmp_path / "proj"
    for pkg in sources.PACKAGES:
        shutil.copytree(sources.ROOT / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_sources_follow_the_files_the_llama_build_imports(llama_dir, tmp_path):
    root = _project_copy(tmp_path)
    model = load_model(llama_dir, torch.float32, "cpu")
    modules = build.model_modules(model)
    pm = PassManager.for_platform("cpu")
    pass_files = [root / p.relative_to(sources.ROOT) for p in pm.source_files()]

    def files():
        return ck.source_factors(modules, pass_files, root)

    before = files()
    for f in ("models/llama.py", "models/decoder.py", "models/layers/attention.py", "models/arch.py"):
        assert f in before
    assert "atomc/ops/rope_kv.py" in before and "atomc/compat.py" in before
    assert "atomc/passes/fuse_silu_mul.py" in before and "atomc/passes/match.py" in before
    # not what this build runs: other families, the loader, the CPU-less kernels, the runtime, the server
    assert not [f for f in before if f.startswith(("atomc/kernels/triton/", "atomc/runtime/", "atomc/serve/"))]
    assert not [f for f in before if f.startswith(("models/qwen", "models/phi3", "models/loader/"))]
    assert "models/registry.py" not in before

    # a new family's file (and a new Triton kernel) changes nothing for Llama on the CPU
    (root / "models" / "fake_family.py").write_text("import torch\nclass FakeForCausalLM(torch.nn.Module): ...\n")
    (root / "atomc" / "kernels" / "triton" / "new_kernel.py").write_text("X = 1\n")
    assert files() == before
    # an edit to a file the Llama trace imports does, and the diff names it
    with open(root / "models" / "layers" / "norm.py", "a") as f:
        f.write("# edited\n")
    after = files()
    rows = ck.diff({"sources": before}, {"sources": after})
    assert [r[0] for r in rows] == ["sources.models/layers/norm.py"]


def test_closure_reads_module_level_imports_only(tmp_path):
    pkg = tmp_path / "models"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nfrom models import b\nfrom . import c\n"
        "if TYPE_CHECKING:\n    from models import typing_only\n"
        "try:\n    import models.d\nexcept ImportError:\n    pass\n"
        "def lazy():\n    from models import registry_entry\n"
    )
    for name in ("b", "c", "d", "typing_only", "registry_entry"):
        (pkg / f"{name}.py").write_text("import torch\n")
    got = [str(p.relative_to(tmp_path)) for p in sources.closure(["models.a"], tmp_path)]
    assert got == ["models/__init__.py", "models/a.py", "models/b.py", "models/c.py", "models/d.py"]


def test_diff_and_nearest():
    a = {"dtype": "float32", "model_config": {"hidden_size": 64, "vocab_size": 10}, "passes": [["p", "1"]]}
    b = {"dtype": "float32", "model_config": {"hidden_size": 128, "vocab_size": 10}, "passes": [["p", "2"]]}
    rows = ck.diff(a, b)
    assert [r[0] for r in rows] == ["model_config.hidden_size", "passes"]
    key, d = ck.nearest(a, {"k1": b, "k2": {**a, "dtype": "bfloat16"}})
    assert key == "k2" and [r[0] for r in d] == ["dtype"]
