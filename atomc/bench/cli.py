"""`atomc bench serve` and `atomc bench sweep` (mounted by the main CLI as `atomc bench`).

The benchmark client (httpx, numpy) is imported inside the commands: the main CLI mounts this app
for every command, and `atomc serve` should not pay for it before it spawns its engine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import typer

bench_app = typer.Typer(
    help="Benchmark an OpenAI-compatible server: one run (serve) or a gated CVS-style sweep.",
    no_args_is_help=True,
)

# the metric block of a result, in the order the table shows it
_SKIP_IN_TABLE = {"date", "base_url", "errors", "combo"}


@bench_app.command("serve")
def serve(
    base_url: str = typer.Option("http://127.0.0.1:8000", help="Server root, without /v1."),
    model: str = typer.Option(None, help="Model to request; default: the first id of GET /v1/models."),
    dataset: str = typer.Option("random", help="Prompt source; only 'random' (token ids)."),
    input_len: int = typer.Option(1024, min=1, help="Prompt length in tokens."),
    output_len: int = typer.Option(128, min=1, help="Generated tokens per request (ignore_eos)."),
    num_prompts: int = typer.Option(100, min=1),
    max_concurrency: int = typer.Option(None, min=1, help="Requests in flight at most; default: all."),
    request_rate: float = typer.Option(math.inf, help="Requests/s, Poisson arrivals; inf: all at once."),
    seed: int = typer.Option(0),
    num_warmups: int = typer.Option(
        0, min=0, help="Requests sent first and not measured (same concurrency, 16 output tokens, other prompts)."
    ),
    random_range_ratio: float = typer.Option(
        0.0, min=0.0, max=0.999, help="Lengths drawn uniformly from len*(1-r) to len*(1+r), as vLLM."
    ),
    vocab_size: int = typer.Option(
        None, min=2, help="Token ids are drawn below this; default: the server's, else 1000."
    ),
    metric_percentiles: str = typer.Option("", help="Extra percentiles, e.g. '50,99.9' (90,95,99 always)."),
    save_result: Path = typer.Option(None, help="Write the result JSON here."),
    api_key: str = typer.Option(None, envvar="OPENAI_API_KEY", help="Sent as a Bearer token."),
    disable_tqdm: bool = typer.Option(False, "--disable-tqdm", help="No progress bar."),
    structured_json_schema: Path = typer.Option(
        None, exists=True, dir_okay=False,
        help="Constrain every request's output to this JSON schema (structured_outputs.json).",
    ),  # fmt: skip
) -> None:
    """Run one benchmark against a running server and print vLLM-named metrics."""
    from atomc.bench.metrics import format_metrics_table, parse_percentiles
    from atomc.bench.serve import BenchConfig, run_benchmark

    if dataset != "random":
        raise typer.BadParameter("only the 'random' dataset is supported", param_hint="--dataset")
    cfg = BenchConfig(
        base_url=base_url,
        model=model,
        input_len=input_len,
        output_len=output_len,
        num_prompts=num_prompts,
        max_concurrency=max_concurrency,
        request_rate=request_rate,
        seed=seed,
        num_warmups=num_warmups,
        random_range_ratio=random_range_ratio,
        vocab_size=vocab_size,
        api_key=api_key,
        percentiles=parse_percentiles(metric_percentiles),
        show_progress=not disable_tqdm,
        extra_body=_structured_body(structured_json_schema),
    )
    result = run_benchmark(cfg)
    typer.echo(format_metrics_table({k: v for k, v in result.items() if k not in _SKIP_IN_TABLE}))
    for error in result["errors"]:
        typer.echo(f"error: {error}", err=True)
    if save_result:
        save_result.parent.mkdir(parents=True, exist_ok=True)
        save_result.write_text(json.dumps(result, indent=2) + "\n")
        typer.echo(f"result written to {save_result}")


def _structured_body(schema_file: Path | None) -> dict | None:
    if schema_file is None:
        return None
    try:
        schema = json.loads(schema_file.read_text())
    except ValueError as e:
        raise typer.BadParameter(f"not JSON: {e}", param_hint="--structured-json-schema") from None
    return {"structured_outputs": {"json": schema}}


def cell_summary_table(cells: dict[str, dict]) -> str:
    from atomc.bench.metrics import format_value
    from atomc.bench.thresholds import render_table

    headers = ["cell", "ok/total", "out tok/s", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms"]
    rows = [
        [
            key,
            f"{m.get('completed')}/{m.get('num_prompts')}",
            format_value(m.get("output_throughput")),
            format_value(m.get("mean_ttft_ms")),
            format_value(m.get("p99_ttft_ms")),
            format_value(m.get("mean_tpot_ms")),
        ]
        for key, m in cells.items()
    ]
    return render_table(headers, rows)


def block_table(blocks) -> str:
    from atomc.bench.thresholds import render_table

    return render_table(["block", "verdict", "reason"], [[b.block, b.verdict, b.reason] for b in blocks])


@bench_app.command("sweep")
def sweep(
    config: Path = typer.Option(
        ..., "--config", "--config_file", exists=True, dir_okay=False, help="CVS ATOM config JSON (schema 1 or 2)."
    ),
    config_profile: str = typer.Option(
        None,
        "--config-profile",
        "--config_profile",  # CVS's spelling
        help="Profile of a schema_version 2 config; default: CVS_CONFIG_PROFILE, "
        "else the file's default_profile, else perf.",
    ),
    threshold: Path = typer.Option(None, help="Threshold JSON; default: the config's threshold_json."),
    base_url: str = typer.Option(
        None,
        help="Benchmark this running OpenAI-compatible server (atomc, vLLM, SGLang) instead of starting atomc serve.",
    ),
    output_dir: Path = typer.Option(Path("."), help="Where report.json, cells/ and server.log go."),
    enforce: bool = typer.Option(None, "--enforce/--no-enforce", help="Override enforce_thresholds."),
    vocab_size: int = typer.Option(None, min=2, help="Token ids are drawn below this."),
    api_key: str = typer.Option(None, envvar="OPENAI_API_KEY", help="Sent as a Bearer token."),
    disable_tqdm: bool = typer.Option(False, "--disable-tqdm", help="No progress bars."),
) -> None:
    """Run a CVS ATOM suite: functional checks, every sweep cell, platform and quality blocks;
    gate them all; exit 1 on a failed enforced gate or block, 2 on a config error."""
    from atomc.bench.suite import run_suite
    from atomc.bench.sweep import ServerUnavailable, SweepConfigError, load_sweep_config
    from atomc.bench.thresholds import format_gate_table

    try:
        cfg = load_sweep_config(config, config_profile)
        typer.echo(f"config {config} (profile {cfg.profile}, driver {cfg.driver}, {len(cfg.cells)} cells)")
        outcome = run_suite(
            cfg,
            base_url=base_url,
            output_dir=output_dir,
            threshold_path=threshold,
            enforce=enforce,
            api_key=api_key,
            vocab_size=vocab_size,
            show_progress=not disable_tqdm,
            log=typer.echo,
        )
    except SweepConfigError as exc:
        typer.echo(f"config error: {exc}", err=True)
        raise typer.Exit(2) from None
    except ServerUnavailable as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    report = outcome.report
    typer.echo("\n" + cell_summary_table(report["cells"]))
    if outcome.blocks:
        typer.echo("\n" + block_table(outcome.blocks))
    if outcome.rows:
        typer.echo("\n" + format_gate_table(outcome.rows))
    for key in report["unmatched_threshold_cells"]:
        typer.echo(f"note: threshold cell {key} matches no run in the sweep")
    if report["threshold_file"] is None:
        typer.echo("note: no threshold file; nothing was gated")
    counts = report["summary"]
    summary = ", ".join(f"{counts[s]} {s}" for s in ("PASS", "FAIL", "SKIP", "INFO"))
    if counts["blocks_failed"]:
        summary += f", {counts['blocks_failed']} blocks FAIL/ERROR"
    mode = "enforced" if report["enforce_thresholds"] else "record-only"
    typer.echo(f"\n{summary} ({mode}); report: {outcome.report_path}")
    _write_deck(report, output_dir)
    raise typer.Exit(outcome.exit_code)


def _write_deck(results: dict, output_dir: Path, prev: Path | None = None, parity: Path | None = None) -> None:
    from atomc.bench.deck import write_deck

    try:
        html_path, json_path = write_deck(results, output_dir, prev, parity)
    except ValueError as exc:  # an unreadable comparison input: the run's own results stand
        typer.echo(f"run deck not written: {exc}", err=True)
        return
    typer.echo(f"run deck: {html_path} (and {json_path.name})")


@bench_app.command("deck")
def deck(
    report: Path = typer.Argument(..., exists=True, dir_okay=False, help="A run's report JSON (report.json)."),
    output_dir: Path = typer.Option(None, help="Where run_deck.html and run_deck.json go; default: beside REPORT."),
    prev_report: Path = typer.Option(
        None, help="A previous run's report, for the prev-run panels; default: $CVS_INFERENCE_PREV_REPORT_JSON."
    ),
    parity_ref: Path = typer.Option(
        None, help="Another framework's report of the same cells; default: $CVS_ATOM_PARITY_REF_JSON."
    ),
) -> None:
    """Render a run's report as the run deck: one self-contained HTML page and its JSON."""
    try:
        data = json.loads(report.read_text())
    except ValueError as exc:
        raise typer.BadParameter(f"{report} is not JSON: {exc}", param_hint="REPORT") from None
    if not isinstance(data, dict):
        raise typer.BadParameter(f"{report} is not a report object", param_hint="REPORT")
    _write_deck(data, output_dir or report.parent, prev_report, parity_ref)
