"""The compile cache key: sha256 of a canonical JSON of every factor that changes the graph.

A factor missing here means a stale artifact silently reused; a factor that does not shape the
artifact means needless rebuilds. So each factor is here for a reason (docs/compilation.md, "Key
factors"), and some things are deliberately absent: the weights (artifacts hold none, one entry
serves every checkpoint of a config), the batch limits and CUDA-graph sizes (the token dim is
unbacked, one graph serves every batch), and where the cache lives.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

from atomc import compat, env
from atomc.graphs import sources
from atomc.kv_spec import canonical_kv_cache_dtype
from atomc.platforms import platform_of
from models.layers.parallel import ParallelInfo

FORMAT_VERSION = 2  # 2: per-file `sources`, no capture sizes, batch limit or cache location

# the code that traces, cuts and stores the graph, whatever the model and passes
TRACING_MODULES = (
    "atomc.compat",
    "atomc.graphs.trace",
    "atomc.graphs.partition",
    "atomc.graphs.artifact",
    "atomc.forward_context",
)
# config.json fields that do not shape the graph
_CONFIG_NOISE = ("transformers_version", "_name_or_path")
# env vars of torch's compiler stack that change generated code. Skipped: the cache dirs (atomc pins
# them) and the tool paths Inductor sets itself when it first compiles a Triton kernel
# (runtime/compile_tasks.py), which made a CUDA process's second key differ from its first
_FOREIGN_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_COMPILE_", "TRITON_")
_FOREIGN_ENV_SKIP = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_PTXAS_PATH", "TRITON_LIBDEVICE_PATH")


def canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def cache_key(factors: dict) -> str:
    return hashlib.sha256(canonical_json(factors).encode()).hexdigest()[:24]


def source_factors(
    model_modules: Iterable[str], pass_files: Iterable[Path], root: Path = sources.ROOT
) -> dict[str, str]:
    """{project file: digest} of every file the build depends on: the model's modules, the passes'
    files (the lowering's include the backend op modules it picks) and the tracing code, each with
    its module-level project imports (atomc/graphs/sources.py)."""
    roots = [*model_modules, *TRACING_MODULES, *(Path(p) for p in pass_files)]
    return sources.digests(sources.closure(roots, root), root)


def model_config(model_dir: Path) -> dict:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return {k: v for k, v in cfg.items() if k not in _CONFIG_NOISE}


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return None


def system_factors(device: str) -> dict:
    is_cuda = device.startswith("cuda")
    gpu = None
    if is_cuda and torch.cuda.is_available():
        idx = torch.device(device).index or 0
        props = torch.cuda.get_device_properties(idx)
        gpu = {
            "name": props.name,
            "capability": list(torch.cuda.get_device_capability(idx)),
            "arch": getattr(props, "gcnArchName", None),
        }
    rocm = torch.version.hip
    return {
        "python": platform.python_version(),
        "python_impl": sys.implementation.name,
        "torch": torch.__version__,
        "torch_key": compat.torch_key(),
        "triton": _version("triton") or _version("pytorch-triton-rocm"),
        "cuda": torch.version.cuda if is_cuda and not rocm else None,
        "rocm": rocm if is_cuda else None,
        "gpu": gpu,
        # kernel libraries are only a factor where they can be picked
        "aiter": _version("aiter") if rocm and is_cuda else None,
        "platform": platform_of(device),
    }


def env_factors() -> dict:
    out = dict(env.graph_snapshot())
    for k, v in sorted(os.environ.items()):
        if k.startswith(_FOREIGN_ENV_PREFIXES) and k not in _FOREIGN_ENV_SKIP:
            out[k] = v
    return out


def collect_factors(
    model_dir: Path,
    config,
    device: str,
    dtype: torch.dtype,
    pass_uuids,
    *,
    source_files: dict[str, str],
    splitting_ops,
    artifact_format: str,
) -> dict:
    """Every input to the build. `config` is an EngineConfig; pass_uuids is PassManager.uuids();
    source_files is source_factors(...)."""
    dtype_name = str(dtype).removeprefix("torch.")
    kv = canonical_kv_cache_dtype(config.cache.kv_cache_dtype)
    return {
        "format_version": FORMAT_VERSION,
        "artifact_format": artifact_format,
        "sources": dict(source_files),
        "system": system_factors(device),
        "device_type": torch.device(device).type,
        "model_config": model_config(model_dir),
        "dtype": dtype_name,
        "kv_cache_dtype": dtype_name if kv == "auto" else kv,
        # --quantization (online FP8 changes every linear's ops); a checkpoint's own scheme is in
        # model_config.quantization_config
        "quantization": config.model.quantization,
        "passes": [[name, uuid] for name, uuid in pass_uuids],
        "splitting_ops": sorted(splitting_ops),
        **parallel_factors(config.parallel),
        "env": env_factors(),
    }


def parallel_factors(par) -> dict:
    """A rank's place: its tensor-parallel shard shapes its graph (and expert parallelism which
    shard: whole experts instead of a slice of each, other weight shapes under the same sizes); its
    pipeline stage picks the layers it holds and whether it starts from ids or hidden states. The
    process's world rank is stage * tp_size + tp_rank (models/layers/parallel.py), so each (stage,
    tp rank) has its own key."""
    place = ParallelInfo.of_world_rank(par.rank, par.tensor_parallel_size, par.pipeline_parallel_size)
    return {
        "tp_size": place.size,
        "tp_rank": place.rank,
        "expert_parallel": par.enable_expert_parallel and place.size > 1,
        "pp_size": place.stages,
        "pp_stage": place.stage,
    }


def flatten(factors: dict, prefix: str = "") -> dict:
    """Dotted paths to leaf values, so diffs name the exact field ('model_config.hidden_size')."""
    out = {}
    for k, v in factors.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, path + "."))
        else:
            out[path] = v
    return out


def diff(a: dict, b: dict) -> list[tuple[str, object, object]]:
    """(path, a value, b value) for every leaf that differs."""
    fa, fb = flatten(a), flatten(b)
    return [(k, fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]


def nearest(factors: dict, candidates: dict[str, dict]) -> tuple[str | None, list]:
    """The candidate key whose factors differ from `factors` in the fewest leaves."""
    best, best_diff = None, []
    for key, other in candidates.items():
        d = diff(other, factors)
        if best is None or len(d) < len(best_diff):
            best, best_diff = key, d
    return best, best_diff


def format_diff(rows: list, left: str = "entry", right: str = "wanted") -> str:
    def short(v):
        s = canonical_json(v) if not isinstance(v, str) else v
        return s if len(s) <= 60 else s[:57] + "..."

    return "\n".join(f"  {path}: {left}={short(x)} {right}={short(y)}" for path, x, y in rows)
