"""Compile or load: the key lookup, the locked build, and the runtime entry `load_or_compile`."""

from __future__ import annotations

import atexit
import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from atomc import compat
from atomc.config import EngineConfig
from atomc.graphs import artifact, signing, sources
from atomc.graphs.cache_key import cache_key, collect_factors, format_diff, nearest, source_factors
from atomc.graphs.cache_store import CacheStore, Entry, make_private_dir
from atomc.graphs.partition import splitting_ops
from atomc.graphs.signing import SigningKey
from atomc.graphs.trace import IDS, AtomcBackend, aot_trace, bind, example_inputs, input_kind
from atomc.kernels.registry import ensure_registered
from atomc.passes.manager import PassManager
from atomc.platforms import platform_of

log = logging.getLogger(__name__)

PRIMARY_FORMAT = "aot_fn"
FALLBACK_FORMAT = "pieces"


class ArtifactsMissing(RuntimeError):
    """`--require-artifacts` and no entry matches; the message lists the factors that differ."""


@dataclass
class CompileResult:
    key: str
    entry_dir: Path
    manifest: dict
    hit: bool
    forward: Callable | None = None
    timings: dict[str, float] = field(default_factory=dict)


def _pass_manager(config: EngineConfig, device: str) -> PassManager:
    return PassManager.for_platform(
        platform_of(device),
        disabled=config.compile.disabled_passes,
        tensor_parallel_size=config.parallel.tensor_parallel_size,
    )


def model_modules(model: torch.nn.Module) -> list[str]:
    """The modules defining the model: every submodule's class, and its parsed config (`model.arch`,
    which turns config.json into the switches the forward reads). Non-project modules drop out later."""
    names = {type(m).__module__ for m in model.modules()}
    # a linear's method (models/quant/) is no module but its apply is traced: FP8 ops, or F.linear
    names.update(type(m.linear_method).__module__ for m in model.modules() if hasattr(m, "linear_method"))
    # likewise a FusedMoE's quantised-experts method (models/quant/mxfp4.py: atomc::moe_quant)
    names.update(type(m.moe_method).__module__ for m in model.modules() if getattr(m, "moe_method", None))
    arch = getattr(model, "arch", None)
    if arch is not None:
        names.add(type(arch).__module__)
    return sorted(names)


def artifact_format() -> str:
    return PRIMARY_FORMAT if hasattr(torch.compiler, "load_compiled_function") else FALLBACK_FORMAT


@dataclass
class Plan:
    """Everything a lookup needs, computed before any tracing."""

    factors: dict
    key: str
    store: CacheStore


def plan_for(
    model_dir: Path,
    config: EngineConfig,
    device: str,
    dtype: torch.dtype,
    pm: PassManager,
    modules: list[str],
    fmt: str | None = None,
) -> Plan:
    """`modules`: model_modules(model), the roots of the model's part of the `sources` factor."""
    factors = collect_factors(
        model_dir,
        config,
        device,
        dtype,
        pm.uuids(),
        source_files=source_factors(modules, pm.source_files()),
        splitting_ops=splitting_ops(),
        artifact_format=fmt or artifact_format(),
    )
    return Plan(factors, cache_key(factors), CacheStore(config.cache_path))


def explain_miss(plan: Plan) -> str:
    candidates = plan.store.ready_factors()
    if not candidates:
        return f"no compiled entries in {plan.store.root}"
    key, rows = nearest(plan.factors, candidates)
    return f"nearest entry {key} differs in {len(rows)} factor(s):\n{format_diff(rows)}"


def load_or_compile(
    model: torch.nn.Module, model_dir: Path, config: EngineConfig, device: str, dtype: torch.dtype
) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], dict]:
    """The compiled forward for `model` (weights already loaded) and an info dict (key, hit, timings)."""
    res = compile_or_load(model, Path(model_dir), config, device, dtype, progress=None)  # a bar on a terminal
    info = {
        "key": res.key,
        "hit": res.hit,
        "timings": res.timings,
        "entry": str(res.entry_dir),
        "format": res.manifest.get("format"),
    }
    return res.forward, info


def compile_or_load(
    model,
    model_dir: Path,
    config: EngineConfig,
    device: str,
    dtype: torch.dtype,
    *,
    progress: bool | None = False,
    pm: PassManager | None = None,
    fmt: str | None = None,
) -> CompileResult:
    t0 = time.perf_counter()
    pm = pm if pm is not None else _pass_manager(config, device)
    plan = plan_for(model_dir, config, device, dtype, pm, model_modules(model), fmt)
    key = signing.load_key(config.compile.cache_signing_key_file)
    entry = plan.store.entry(plan.key)
    res = _try_load(entry, model, pm, t0, key, raise_errors=config.compile.require_artifacts)
    if res is not None:
        return res
    if not plan.store.writable:
        raise ArtifactsMissing(
            f"the compile cache {plan.store.root} is read-only and has no entry for key {plan.key}; "
            f"{explain_miss(plan)}\nbuild it where the cache is writable (`atomc compile`), or use --enforce-eager"
        )
    if config.compile.require_artifacts:
        raise ArtifactsMissing(
            f"--require-artifacts: no compiled entry for key {plan.key}; {explain_miss(plan)}\n"
            f"run `atomc compile --model {model_dir}` with the same flags first"
        )
    with plan.store.lock(plan.key):
        res = _try_load(entry, model, pm, t0, key)  # another process may have built it while we waited
        if res is not None:
            return res
        manifest = _build(model, device, pm, plan, key, progress=progress)
    res = _try_load(entry, model, pm, t0, key, raise_errors=True)
    res.hit, res.timings = False, {**manifest["timings"], "total_s": time.perf_counter() - t0}
    return res


def _try_load(entry: Entry, model, pm, t0: float, key: SigningKey, raise_errors: bool = False) -> CompileResult | None:
    """The entry's compiled forward, or None to build it. Nothing is read from the cache in place:
    the entry's files are copied into a private folder as they are checked against the signed
    manifest, and the artifact and its kernels load from there (Inductor's cache dir included), so
    loading writes nothing into the cache and runs nothing the signature does not cover."""
    if not entry.ready:
        return None
    store = CacheStore(entry.root)
    distrust = entry.trust_problems()
    if distrust:  # an artifact is code: never run one someone else could have written
        raise artifact.ArtifactError(
            f"compile cache entry {entry.path} is not trusted ({'; '.join(distrust)}); it was not loaded. "
            "Entries must be owned by this user and writable by nobody else (see docs/compilation.md)"
        )
    staged = _private_load_dir() / entry.key
    check = entry.check(key, stage_to=staged)
    if check.problems:
        what, fix = _refusal(entry, check)
        if raise_errors or not store.writable:  # a read-only entry is not ours to delete
            raise artifact.ArtifactError(f"compile cache entry {entry.key} is {what}; it was not loaded. {fix}")
        log.warning("compile cache entry %s is %s; rebuilding it", entry.key, what)
        with contextlib.suppress(OSError):
            store.remove(entry.key)
        return None
    manifest = check.manifest
    kind = manifest.get("input_kind", IDS)  # entries from before pipeline stages compiled take ids
    if kind != input_kind(model):  # the key's pp_stage should make this impossible: never call it wrong
        raise artifact.ArtifactError(
            f"compile cache entry {entry.key} takes {kind} but this model starts from {input_kind(model)}"
        )
    t1 = time.perf_counter()
    _register_backend_ops(manifest)
    kernels = staged / artifact.KERNELS_DIR
    make_private_dir(kernels)  # Inductor writes its sources and locks here, never into the cache
    try:
        with compat.inductor_cache_dir(str(kernels)):
            fn = _load_format(manifest, staged, model, pm)
    except artifact.ArtifactError:
        if raise_errors or not store.writable:
            raise
        log.warning("compile cache entry %s failed to load; rebuilding", entry.key, exc_info=True)
        store.remove(entry.key)
        return None
    load_s = time.perf_counter() - t1
    timings = {"load_s": load_s, "total_s": time.perf_counter() - t0}
    return CompileResult(entry.key, entry.path, manifest, hit=True, forward=bind(fn, model, kind), timings=timings)


def _refusal(entry: Entry, check) -> tuple[str, str]:
    """(what is wrong, how to fix it) for an entry that failed its check."""
    sig = check.signature
    if sig is not None and sig.kind == signing.OTHER_KEY:
        return (
            f"signed with another key ({sig.message})",
            "Run with the key that signed this cache (--cache-signing-key-file or ATOMC_CACHE_SIGNING_KEY_FILE), "
            "or rebuild it with this key where the cache is writable (`atomc compile`)",
        )
    if sig is not None and sig.kind == signing.UNSIGNED:
        return (
            "not signed (built before atomc signed its cache entries)",
            "Rebuild it with `atomc compile` where the cache is writable",
        )
    return f"damaged ({'; '.join(check.problems)})", f"`atomc cache clear {entry.key}` removes it"


_load_root: Path | None = None


def _private_load_dir() -> Path:
    """A fresh private folder (0700, ours) under the system's temporary dir for one load's copies. It
    lives until the process exits: Inductor may read its files after the load returns."""
    global _load_root
    if _load_root is None or not _load_root.is_dir():
        _load_root = Path(tempfile.mkdtemp(prefix="atomc-load-"))
        atexit.register(shutil.rmtree, _load_root, ignore_errors=True)
    return Path(tempfile.mkdtemp(dir=_load_root))


def _register_backend_ops(manifest: dict) -> None:
    """The artifact calls backend ops (atomc_triton::...) by name: define them before unpickling."""
    ensure_registered(manifest["factors"]["system"]["platform"])


def _load_format(manifest: dict, entry_dir: Path, model, pm) -> Callable:
    if manifest["format"] == PRIMARY_FORMAT:
        return artifact.load_aot(entry_dir, manifest["factors"]["system"]["platform"])
    # pieces: re-trace with Dynamo (same passes), then swap the stored pieces in; Inductor never runs
    backend = AtomcBackend(pm, compile_fn=artifact.load_pieces_backend(entry_dir, manifest["pieces"]))
    return compat.compile_unguarded(
        type(model).forward, backend, model, *example_inputs(model, next(model.parameters()).device)
    )


def _build(model, device: str, pm: PassManager, plan: Plan, key: SigningKey, *, progress: bool | None) -> dict:
    from atomc.graphs.progress import Phases

    fmt = plan.factors["artifact_format"]
    entry = plan.store.begin(plan.key)
    bar = Phases(["trace", "passes", "inductor", "save", "commit"], enabled=progress)
    files: list[str] = []
    pieces: list[str] = []
    compile_fn = artifact.compile_pieces(entry.path, files, pieces) if fmt == FALLBACK_FORMAT else None
    backend = AtomcBackend(pm, on_phase=bar.done, compile_fn=compile_fn)
    t0 = time.perf_counter()
    # Inductor builds in a cache of its own inside the entry, so the kernels a load needs are the
    # entry's (signed with it), and no file another process left in a shared cache enters the build
    with compat.inductor_cache_dir(str(entry.path / artifact.KERNELS_DIR)):
        if fmt == PRIMARY_FORMAT:
            compiled = aot_trace(model, device, backend)
            t1 = time.perf_counter()
            files += artifact.save_aot(compiled, entry.path)
        else:
            compat.compile_unguarded(type(model).forward, backend, model, *example_inputs(model, device))
            t1 = time.perf_counter()
    files += artifact.keep_kernels(entry.path)
    rec = backend.record
    timings = {**rec.timings, "save_s": time.perf_counter() - t1, "compile_total_s": time.perf_counter() - t0}
    bar.done("save")
    graph_files = _write_graphs(entry, rec)
    traced = sources.project_files(rec.traced_files)
    unhashed = sorted(set(traced) - set(plan.factors["sources"]))
    if unhashed:  # the key would not see an edit there: say so (tests/graphs check it never happens)
        log.warning("traced files missing from the cache key's sources: %s", ", ".join(unhashed))
    manifest = {
        "key": plan.key,
        "format": fmt,
        "input_kind": input_kind(model),  # the calling convention: token ids, or a stage's hidden states
        "factors": plan.factors,
        "passes": [
            {
                "name": r.name,
                "uuid": r.uuid,
                "matched": r.matched,
                "rewritten": r.rewritten,
                "seconds": r.seconds,
                "notes": r.notes,
                "graph": graph_files.get(r.name),
            }
            for r in rec.pass_reports
        ],
        "graph_before": graph_files.get("<before>"),
        "partitions": rec.plan,
        "splitting_ops": rec.splitting_ops,
        "traced_files": traced,
        "flops": rec.flops,
        "pieces": pieces,
        "timings": timings,
    }
    manifest = plan.store.commit(entry, manifest, files, key)
    bar.done("commit")
    bar.close()
    return manifest


def _write_graphs(entry: Entry, rec) -> dict[str, str]:
    """The graph before and after each pass as Python, for `atomc cache show --graph`."""
    gdir = entry.path / "graphs"
    gdir.mkdir(exist_ok=True)
    out = {"<before>": "graphs/00_before.py"}
    (entry.path / out["<before>"]).write_text(rec.graph_before)
    for i, r in enumerate(rec.pass_reports, 1):
        rel = f"graphs/{i:02d}_{r.name}.py"
        (entry.path / rel).write_text(r.graph_after)
        out[r.name] = rel
    return out


def resolve_target(config: EngineConfig) -> tuple[Path, str, torch.dtype]:
    """(model dir, device, dtype) exactly as the engine resolves them, so keys agree with `serve`."""
    from atomc.config import resolve_device, resolve_dtype
    from models.arch import ModelArch
    from models.loader.default_model import resolve_model_path

    device = resolve_device(config.device)
    model_dir = Path(resolve_model_path(config.model.model, config.cache_path))
    return model_dir, device, resolve_dtype(config.model.dtype, ModelArch.from_dir(model_dir).torch_dtype, device)


def compile_model(config: EngineConfig, progress: bool = True) -> CompileResult:
    """`atomc compile`: build the entry for this config (or report the existing one)."""
    from models.loader import load_model

    model_dir, device, dtype = resolve_target(config)
    t0 = time.perf_counter()
    model = load_model(model_dir, dtype, device, quantization=config.model.quantization)
    load_s = time.perf_counter() - t0
    res = compile_or_load(model, model_dir, config, device, dtype, progress=progress)
    res.timings = {"load_weights_s": load_s, **res.timings}
    return res


def plan_from_config(config: EngineConfig) -> tuple[Plan, Path]:
    """The key this config would use, without loading weights (for `atomc cache explain`): the model
    is built on the meta device, only to name its modules."""
    from models.arch import ModelArch
    from models.loader.safetensors import build_on_meta

    model_dir, device, dtype = resolve_target(config)
    model = build_on_meta(ModelArch.from_dir(model_dir), dtype, quantization=config.model.quantization)
    pm = _pass_manager(config, device)
    return plan_for(model_dir, config, device, dtype, pm, model_modules(model)), model_dir
