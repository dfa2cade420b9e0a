"""`atomc cache ...` (typer app) and `compile_command`, which `atomc compile` calls.

The graph modules (torch) are imported inside the commands, so `atomc --help` stays fast.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from typing import TYPE_CHECKING, Annotated

import typer

from atomc import env
from atomc.cli.flags import (
    CacheDir,
    Device,
    DisablePass,
    Dtype,
    KvCacheDtype,
    Model,
    Quantization,
    SigningKeyFile,
    config_from,
)
from atomc.config import CacheConfig, EngineConfig, ModelConfig

if TYPE_CHECKING:
    from atomc.graphs.cache_store import CacheStore, Entry
    from atomc.graphs.signing import SigningKey

cache_app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"max_content_width": 120, "help_option_names": ["-h", "--help"]},
)

AsJson = Annotated[bool, typer.Option("--json", help="machine-readable output")]


def compile_command(config: EngineConfig, as_json: bool) -> int:
    from atomc.graphs.build import compile_model
    from atomc.graphs.report import to_json

    par = config.parallel
    if par.tensor_parallel_size > 1 or par.pipeline_parallel_size > 1:
        from atomc.runtime.compile_ranks import compile_ranks

        manifests = [_compile_manifest(r.manifest, r.hit, r.timings, r.entry_dir, rank=r.rank)
                     for r in compile_ranks(config)]  # fmt: skip
        if as_json:
            typer.echo(to_json({"ranks": manifests}))
        else:
            for m in manifests:
                _echo_compiled(m, f"{_rank_label(m, par)}: ")
        return 0
    res = compile_model(config, progress=sys.stderr.isatty() and not as_json)
    manifest = _compile_manifest(res.manifest, res.hit, res.timings, res.entry_dir)
    if as_json:
        typer.echo(to_json(manifest))
    else:
        _echo_compiled(manifest)
    return 0


def _rank_label(manifest: dict, par) -> str:
    """How `atomc compile` names a rank's entry: its stage, its tensor-parallel rank, or both."""
    f = manifest["factors"]
    if par.pipeline_parallel_size == 1:
        return f"rank {manifest['rank']}"
    if par.tensor_parallel_size == 1:
        return f"stage {f['pp_stage']}"
    return f"stage {f['pp_stage']} tensor-parallel rank {f['tp_rank']} (rank {manifest['rank']})"


def _compile_manifest(manifest: dict, hit: bool, timings: dict, entry_dir, **extra) -> dict:
    """What `atomc compile` reports of one entry."""
    return {**manifest, **extra, "hit": hit, "run_timings": timings, "entry": str(entry_dir)}


def _echo_compiled(manifest: dict, prefix: str = "") -> None:
    from atomc.graphs.report import format_report

    typer.echo(prefix + ("cache hit: " if manifest["hit"] else "compiled: ") + manifest["entry"])
    typer.echo(format_report(manifest))


def _store(cache_dir: str | None) -> CacheStore:
    from atomc.graphs.cache_store import CacheStore

    return CacheStore(cache_dir or env.cache_dir())


def _signing_key(path: str | None) -> tuple[SigningKey | None, str]:
    """The signing key (never created here: a check must not mint the key it checks against),
    or None and why not."""
    from atomc.graphs.signing import SigningKeyError, load_key

    try:
        return load_key(path, create=False), ""
    except SigningKeyError as e:
        return None, str(e)


def _resolve(store: CacheStore, key: str) -> Entry:
    try:
        return store.resolve(key)
    except KeyError as e:
        hint = ""
        if any(m.name == key for m in store.converted_models()) or key == "models":
            hint = " (that is a converted model, not a compile entry: `atomc cache ls` lists both)"
        typer.secho(f"error: {e.args[0]}{hint}", err=True, fg=typer.colors.RED)
        raise typer.Exit(2) from None


def _manifest(e: Entry) -> dict:
    from atomc.graphs.cache_store import ManifestError

    try:
        return e.manifest()
    except ManifestError as err:
        typer.secho(f"error: {err} (`atomc cache clear {e.key}` removes it)", err=True, fg=typer.colors.RED)
        raise typer.Exit(1) from None


def _summary(e: Entry) -> dict:
    from atomc.graphs.cache_store import ManifestError

    row = {"key": e.key, "ready": e.ready, "size_bytes": e.size_bytes()}
    try:
        m = e.manifest()
    except ManifestError:
        return row
    f = m.get("factors", {})
    cfg = f.get("model_config", {})
    arch = (cfg.get("architectures") or [cfg.get("model_type", "?")])[0]
    stage = f" stage {f['pp_stage']}/{f['pp_size']}" if f.get("pp_size", 1) > 1 else ""  # one entry a stage
    row.update(
        model=f"{arch} L{cfg.get('num_hidden_layers', '?')} H{cfg.get('hidden_size', '?')}{stage}",
        format=m.get("format"),
        device=f.get("system", {}).get("platform"),
        dtype=f.get("dtype"),
        torch=f.get("system", {}).get("torch"),
        passes=len(f.get("passes", [])),
        created=m.get("created"),
    )
    return row


def _model_rows(store: CacheStore) -> list[dict]:
    return [
        {"name": m.name, "complete": m.complete, "size_bytes": m.size_bytes(), "path": str(m.path)}
        for m in store.converted_models()
    ]


@cache_app.command("ls")
def ls(cache_dir: CacheDir = None, as_json: AsJson = False) -> None:
    """List compile entries and, apart from them, converted models (sizes included)."""
    from atomc.graphs.report import human_bytes, to_json

    store = _store(cache_dir)
    rows = [_summary(e) for e in store.entries()]
    models = _model_rows(store)
    if as_json:
        typer.echo(to_json({"entries": rows, "models": models}))
        return
    if not rows:
        typer.echo(f"no compile entries in {store.root}")
    else:
        typer.echo(f"{'KEY':<26}{'READY':<7}{'FORMAT':<8}{'DEVICE':<7}{'DTYPE':<10}{'TORCH':<14}{'SIZE':>10}  MODEL")
        for r in rows:
            typer.echo(
                f"{r['key']:<26}{'yes' if r['ready'] else 'NO':<7}{r.get('format') or '-':<8}"
                f"{r.get('device') or '-':<7}{r.get('dtype') or '-':<10}{r.get('torch') or '-':<14}"
                f"{human_bytes(r['size_bytes']):>10}  {r.get('model', '-')}"
            )
    if models:
        typer.echo(f"\nconverted models in {store.models_dir}")
        typer.echo(f"{'NAME':<48}{'COMPLETE':<10}{'SIZE':>10}")
        for m in models:
            typer.echo(f"{m['name']:<48}{'yes' if m['complete'] else 'NO':<10}{human_bytes(m['size_bytes']):>10}")


@cache_app.command("show")
def show(
    key: str,
    graph: Annotated[str | None, typer.Option("--graph", help="print the graph after this pass (or 'before')")] = None,
    cache_dir: CacheDir = None,
    as_json: AsJson = False,
) -> None:
    """Factors, pass report, partitions, sizes and timings of one entry."""
    from atomc.graphs.report import format_report, to_json

    e = _resolve(_store(cache_dir), key)
    m = _manifest(e)
    if graph is not None:
        rel = (
            m.get("graph_before")
            if graph == "before"
            else next((p.get("graph") for p in m.get("passes", []) if p.get("name") == graph), None)
        )
        if not rel:
            names = ", ".join(["before"] + [p.get("name", "?") for p in m.get("passes", [])])
            typer.secho(f"error: no graph for pass {graph!r} (have: {names})", err=True, fg=typer.colors.RED)
            raise typer.Exit(2)
        typer.echo((e.path / rel).read_text())
        return
    if as_json:
        typer.echo(to_json(m))
        return
    typer.echo(format_report(m))
    typer.echo("factors")
    typer.echo(json.dumps(m.get("factors", {}), indent=2, sort_keys=True, default=str))


@cache_app.command("diff")
def diff_cmd(key1: str, key2: str, cache_dir: CacheDir = None, as_json: AsJson = False) -> None:
    """Factors that differ between two entries."""
    from atomc.graphs.cache_key import diff, format_diff
    from atomc.graphs.report import to_json

    store = _store(cache_dir)
    a, b = _resolve(store, key1), _resolve(store, key2)
    rows = diff(_manifest(a)["factors"], _manifest(b)["factors"])
    if as_json:
        typer.echo(to_json([{"factor": p, key1: x, key2: y} for p, x, y in rows]))
    elif not rows:
        typer.echo("no differing factors")
    else:
        typer.echo(format_diff(rows, left=a.key[:8], right=b.key[:8]))


@cache_app.command("explain")
def explain(
    model: Model = None,
    device: Device = EngineConfig.device,
    dtype: Dtype = ModelConfig.dtype,
    quantization: Quantization = None,
    kv_cache_dtype: KvCacheDtype = CacheConfig.kv_cache_dtype,
    disable_pass: DisablePass = None,
    cache_dir: CacheDir = None,
    cache_signing_key_file: SigningKeyFile = None,
) -> None:
    """Would these flags hit the cache? If not, the nearest entry and the factors that differ.
    Only the flags that change the key are taken: batch limits and CUDA-graph sizes do not."""
    from atomc.graphs.build import explain_miss, plan_from_config

    cfg = config_from(locals())
    plan, _ = plan_from_config(cfg)
    e = plan.store.entry(plan.key)
    if e.ready:
        key, why = _signing_key(cfg.compile.cache_signing_key_file)
        problems = e.verify(key) if key is not None else [f"signature not checked: {why}"]
        typer.echo(f"hit: {plan.key}" + (f" (but damaged: {'; '.join(problems)})" if problems else ""))
        raise typer.Exit(1 if problems else 0)
    typer.echo(f"miss: key {plan.key}\n{explain_miss(plan)}")
    raise typer.Exit(1)


@cache_app.command("verify")
def verify(
    key: Annotated[str | None, typer.Argument()] = None,
    cache_dir: CacheDir = None,
    cache_signing_key_file: SigningKeyFile = None,
) -> None:
    """Check every compile entry's signature, its files against the signed manifest's checksums,
    ownership and modes, and that converted models finished converting; non-zero exit if anything
    is bad."""
    store = _store(cache_dir)
    entries = [_resolve(store, key)] if key else store.entries()
    models = [] if key else store.converted_models()
    signing_key, why = _signing_key(cache_signing_key_file)
    bad = 0
    for e in entries:
        checked = e.verify(signing_key) if signing_key is not None else [f"signature not checked: {why}"]
        problems = checked + e.trust_problems()
        bad += bool(problems)
        typer.echo(f"{e.key}  " + ("ok" if not problems else "BAD: " + "; ".join(problems)))
    for m in models:
        bad += not m.complete
        typer.echo(f"models/{m.name}  " + ("ok" if m.complete else "BAD: conversion did not finish"))
    if bad:
        typer.secho(
            f"{bad} of {len(entries) + len(models)} damaged (`atomc cache clear KEY` removes an entry, "
            "`atomc cache clear --model NAME` a converted model)",
            err=True,
        )
        raise typer.Exit(1)


@cache_app.command("clear")
def clear(
    key: Annotated[str | None, typer.Argument()] = None,
    older_than: Annotated[float | None, typer.Option("--older-than", help="days")] = None,
    all_: Annotated[
        bool, typer.Option("--all", help="every compile entry and the old shared Inductor cache (not converted models)")
    ] = False,
    model: Annotated[
        str | None, typer.Option("--model", help="a converted model by name (see `ls`); 'all' for every one")
    ] = None,
    cache_dir: CacheDir = None,
) -> None:
    """Remove one entry, entries older than N days, every entry, or converted models."""
    store = _store(cache_dir)
    if sum(x is not None and x is not False for x in (key, older_than, all_, model)) != 1:
        typer.secho(
            "error: give exactly one of KEY, --older-than DAYS, --all, --model NAME", err=True, fg=typer.colors.RED
        )
        raise typer.Exit(2)
    if model is not None:
        found = [m for m in store.converted_models() if model in (m.name, "all")]
        if not found:
            typer.secho(f"error: no converted model {model!r} in {store.models_dir}", err=True, fg=typer.colors.RED)
            raise typer.Exit(2)
        for m in found:
            shutil.rmtree(m.path, ignore_errors=True)
        typer.echo(f"removed {len(found)} converted model{'' if len(found) == 1 else 's'}")
        return
    if key:
        targets = [_resolve(store, key)]
    elif all_:
        targets = store.entries()
    else:
        cutoff = time.time() - older_than * 86400
        targets = [e for e in store.entries() if _created(e) < cutoff]
    for e in targets:
        store.remove(e.key)
    if all_:
        shutil.rmtree(store.legacy_inductor_dir, ignore_errors=True)
    typer.echo(f"removed {len(targets)} entr{'y' if len(targets) == 1 else 'ies'}")


def _created(e: Entry) -> float:
    try:
        return float(e.manifest()["created"])
    except Exception:  # unfinished or malformed entry: fall back to the directory's age
        return e.path.stat().st_mtime
