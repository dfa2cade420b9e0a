"""`atomc cache ...` (typer app) and `compile_command`, which `atomc compile` calls."""

from __future__ import annotations

import json
import shutil
import sys
import time
from typing import Annotated

import typer

from atomc import env
from atomc.cli.flags import (
    CacheDir,
    CaptureSizes,
    Device,
    DisablePass,
    Dtype,
    MaxBatchedTokens,
    MaxNumSeqs,
    Model,
    config_from,
)
from atomc.config import EngineConfig, ModelConfig, SchedulerConfig
from atomc.graphs.cache_key import diff, format_diff
from atomc.graphs.cache_store import CacheStore, Entry
from atomc.graphs.report import format_report, human_bytes, to_json

cache_app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

AsJson = Annotated[bool, typer.Option("--json", help="machine-readable output")]


def compile_command(config: EngineConfig, as_json: bool) -> int:
    from atomc.graphs.build import compile_model

    res = compile_model(config, progress=sys.stderr.isatty() and not as_json)
    manifest = {**res.manifest, "hit": res.hit, "run_timings": res.timings, "entry": str(res.entry_dir)}
    if as_json:
        typer.echo(to_json(manifest))
    else:
        typer.echo(("cache hit: " if res.hit else "compiled: ") + str(res.entry_dir))
        typer.echo(format_report(manifest))
    return 0


def _store(cache_dir: str | None) -> CacheStore:
    return CacheStore(cache_dir or env.cache_dir())


def _resolve(store: CacheStore, key: str) -> Entry:
    try:
        return store.resolve(key)
    except KeyError as e:
        typer.secho(f"error: {e.args[0]}", err=True, fg=typer.colors.RED)
        raise typer.Exit(2) from None


def _summary(e: Entry) -> dict:
    row = {"key": e.key, "ready": e.ready, "size_bytes": e.size_bytes()}
    try:
        m = e.manifest()
    except Exception:
        return row
    f = m.get("factors", {})
    cfg = f.get("model_config", {})
    arch = (cfg.get("architectures") or [cfg.get("model_type", "?")])[0]
    row.update(
        model=f"{arch} L{cfg.get('num_hidden_layers', '?')} H{cfg.get('hidden_size', '?')}",
        format=m.get("format"),
        device=f.get("system", {}).get("platform"),
        dtype=f.get("dtype"),
        torch=f.get("system", {}).get("torch"),
        passes=len(f.get("passes", [])),
        created=m.get("created"),
    )
    return row


@cache_app.command("ls")
def ls(cache_dir: CacheDir = None, as_json: AsJson = False) -> None:
    """List entries."""
    rows = [_summary(e) for e in _store(cache_dir).entries()]
    if as_json:
        typer.echo(to_json(rows))
        return
    if not rows:
        typer.echo(f"no entries in {_store(cache_dir).root}")
        return
    typer.echo(f"{'KEY':<26}{'READY':<7}{'FORMAT':<8}{'DEVICE':<7}{'DTYPE':<10}{'TORCH':<14}{'SIZE':>10}  MODEL")
    for r in rows:
        typer.echo(
            f"{r['key']:<26}{'yes' if r['ready'] else 'NO':<7}{r.get('format') or '-':<8}{r.get('device') or '-':<7}"
            f"{r.get('dtype') or '-':<10}{r.get('torch') or '-':<14}{human_bytes(r['size_bytes']):>10}  "
            f"{r.get('model', '-')}"
        )


@cache_app.command("show")
def show(
    key: str,
    graph: Annotated[str | None, typer.Option("--graph", help="print the graph after this pass (or 'before')")] = None,
    cache_dir: CacheDir = None,
    as_json: AsJson = False,
) -> None:
    """Factors, pass report, partitions, sizes and timings of one entry."""
    e = _resolve(_store(cache_dir), key)
    m = e.manifest()
    if graph is not None:
        rel = (
            m.get("graph_before")
            if graph == "before"
            else next((p.get("graph") for p in m.get("passes", []) if p["name"] == graph), None)
        )
        if not rel:
            names = ", ".join(["before"] + [p["name"] for p in m.get("passes", [])])
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
    store = _store(cache_dir)
    a, b = _resolve(store, key1), _resolve(store, key2)
    rows = diff(a.manifest()["factors"], b.manifest()["factors"])
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
    max_num_batched_tokens: MaxBatchedTokens = SchedulerConfig.max_num_batched_tokens,
    max_num_seqs: MaxNumSeqs = SchedulerConfig.max_num_seqs,
    cudagraph_capture_sizes: CaptureSizes = None,
    disable_pass: DisablePass = None,
    cache_dir: CacheDir = None,
) -> None:
    """Would these flags hit the cache? If not, the nearest entry and the factors that differ."""
    from atomc.graphs.build import explain_miss, plan_from_config

    cfg = config_from(locals())
    plan, _ = plan_from_config(cfg)
    e = plan.store.entry(plan.key)
    if e.ready:
        problems = e.verify()
        typer.echo(f"hit: {plan.key}" + (f" (but damaged: {'; '.join(problems)})" if problems else ""))
        raise typer.Exit(1 if problems else 0)
    typer.echo(f"miss: key {plan.key}\n{explain_miss(plan)}")
    raise typer.Exit(1)


@cache_app.command("verify")
def verify(key: Annotated[str | None, typer.Argument()] = None, cache_dir: CacheDir = None) -> None:
    """Check every entry's files against the manifest checksums; non-zero exit if any is bad."""
    store = _store(cache_dir)
    entries = [_resolve(store, key)] if key else store.entries()
    bad = 0
    for e in entries:
        problems = e.verify()
        bad += bool(problems)
        typer.echo(f"{e.key}  " + ("ok" if not problems else "BAD: " + "; ".join(problems)))
    if bad:
        typer.secho(f"{bad} of {len(entries)} entries damaged (`atomc cache clear KEY` removes one)", err=True)
        raise typer.Exit(1)


@cache_app.command("clear")
def clear(
    key: Annotated[str | None, typer.Argument()] = None,
    older_than: Annotated[float | None, typer.Option("--older-than", help="days")] = None,
    all_: Annotated[bool, typer.Option("--all", help="every entry and Inductor's pinned cache")] = False,
    cache_dir: CacheDir = None,
) -> None:
    """Remove one entry, entries older than N days, or everything."""
    store = _store(cache_dir)
    if sum(x is not None and x is not False for x in (key, older_than, all_)) != 1:
        typer.secho("error: give exactly one of KEY, --older-than DAYS, --all", err=True, fg=typer.colors.RED)
        raise typer.Exit(2)
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
        shutil.rmtree(store.inductor_dir, ignore_errors=True)
    typer.echo(f"removed {len(targets)} entr{'y' if len(targets) == 1 else 'ies'}")


def _created(e: Entry) -> float:
    try:
        return float(e.manifest()["created"])
    except Exception:  # unfinished entry: fall back to the directory's age
        return e.path.stat().st_mtime
