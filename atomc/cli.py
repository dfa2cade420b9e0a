"""`atomc` command line: compile | serve | generate | cache | bench. Flags map onto EngineConfig."""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Annotated

import typer

from atomc.config import EngineConfig

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="atomc: compile a model once, then serve it fast.",
)

# -- shared engine flags (vLLM's names) ------------------------------------------------------------

Model = Annotated[
    str | None,
    typer.Option("--model", help="HF checkpoint dir or .gguf file (default: SmolLM2-135M-Instruct)"),
]
Device = Annotated[str, typer.Option("--device", help="auto | cpu | cuda | cuda:N")]
Dtype = Annotated[str, typer.Option("--dtype", help="auto | float32 | float16 | bfloat16")]
MaxModelLen = Annotated[int | None, typer.Option("--max-model-len")]
MaxNumSeqs = Annotated[int, typer.Option("--max-num-seqs")]
MaxBatchedTokens = Annotated[int, typer.Option("--max-num-batched-tokens")]
BlockSize = Annotated[int, typer.Option("--block-size")]
Seed = Annotated[int, typer.Option("--seed")]
EnforceEager = Annotated[bool, typer.Option("--enforce-eager", help="run the eager model; never compile")]
PrefixCaching = Annotated[bool, typer.Option("--enable-prefix-caching/--no-enable-prefix-caching")]
CacheDir = Annotated[str | None, typer.Option("--cache-dir", help="compile cache (default ~/.cache/atomc)")]
RequireArtifacts = Annotated[
    bool, typer.Option("--require-artifacts", help="fail on a compile-cache miss instead of compiling")
]
GpuMem = Annotated[float, typer.Option("--gpu-memory-utilization")]
KvBlocks = Annotated[int | None, typer.Option("--num-kv-blocks", help="KV pool size in blocks (overrides sizing)")]
CaptureSizes = Annotated[
    str | None, typer.Option("--cudagraph-capture-sizes", help="comma-separated batch sizes, e.g. 1,2,4,8")
]
MixedMaxTokens = Annotated[
    int,
    typer.Option(
        "--cudagraph-mixed-max-tokens",
        help="CUDA graphs for mixed (prefill + decode) batches up to N tokens (default 0: off)",
    ),
]
AsyncScheduling = Annotated[
    bool,
    typer.Option(
        "--async-scheduling/--no-async-scheduling",
        help="launch each step before the previous step's tokens are read back (default on)",
    ),
]
GenerationConfig = Annotated[
    str, typer.Option("--generation-config", help="auto: sampling defaults from generation_config.json; none")
]
LoadFormat = Annotated[str, typer.Option("--load-format", help="safetensors | dummy (random weights)")]
DisablePass = Annotated[list[str] | None, typer.Option("--disable-pass", help="skip a compiler pass by name")]


def build_config(
    model=None,
    device="auto",
    dtype="auto",
    max_model_len=None,
    max_num_seqs=256,
    max_num_batched_tokens=8192,
    block_size=16,
    seed=0,
    enforce_eager=False,
    enable_prefix_caching=True,
    cache_dir=None,
    require_artifacts=False,
    gpu_memory_utilization=0.9,
    num_kv_blocks=None,
    cudagraph_capture_sizes=None,
    cudagraph_mixed_max_tokens=0,
    async_scheduling=True,
    disable_pass=None,
    load_format="safetensors",
    generation_config="auto",
) -> EngineConfig:
    cfg = EngineConfig(device=device)
    cfg.model.model, cfg.model.dtype, cfg.model.max_model_len, cfg.model.seed = (
        model,
        dtype,
        max_model_len,
        seed,
    )
    cfg.scheduler.max_num_seqs = max_num_seqs
    cfg.scheduler.max_num_batched_tokens = max_num_batched_tokens
    cfg.scheduler.async_scheduling = async_scheduling
    cfg.cache.block_size, cfg.cache.enable_prefix_caching = block_size, enable_prefix_caching
    cfg.cache.gpu_memory_utilization, cfg.cache.num_kv_blocks = gpu_memory_utilization, num_kv_blocks
    cfg.compile.enforce_eager, cfg.compile.require_artifacts = enforce_eager, require_artifacts
    if cache_dir:
        cfg.compile.cache_dir = cache_dir
    if cudagraph_capture_sizes:
        cfg.compile.cudagraph_capture_sizes = parse_sizes(cudagraph_capture_sizes)
    cfg.compile.cudagraph_mixed_max_tokens = cudagraph_mixed_max_tokens
    cfg.compile.disabled_passes = list(disable_pass or [])
    cfg.model.load_format, cfg.model.generation_config = load_format, generation_config
    return cfg


_CONFIG_FLAGS = frozenset(inspect.signature(build_config).parameters)


def config_from(flags: dict) -> EngineConfig:
    """build_config from a command's locals(): each command passes the engine flags it declares."""
    return build_config(**{k: v for k, v in flags.items() if k in _CONFIG_FLAGS})


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise typer.BadParameter(f"--cudagraph-capture-sizes wants comma-separated integers, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise typer.BadParameter("capture sizes must be positive integers")
    return sizes


def fail(message: str, code: int = 1) -> typer.Exit:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(code)


# -- generate ----------------------------------------------------------------------------------------


@app.command()
def generate(
    prompt: Annotated[str, typer.Option("--prompt", help="the prompt text")],
    model: Model = None,
    chat: Annotated[bool, typer.Option("--chat", help="wrap the prompt in the model's chat template")] = False,
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 64,
    temperature: Annotated[float, typer.Option("--temperature")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k")] = 0,
    min_p: Annotated[float, typer.Option("--min-p")] = 0.0,
    repetition_penalty: Annotated[float, typer.Option("--repetition-penalty")] = 1.0,
    stop: Annotated[list[str] | None, typer.Option("--stop", help="stop string (repeatable)")] = None,
    sample_seed: Annotated[int | None, typer.Option("--sample-seed", help="per-request sampling seed")] = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    max_model_len: MaxModelLen = None,
    seed: Seed = 0,
    enforce_eager: EnforceEager = False,
    cache_dir: CacheDir = None,
    require_artifacts: RequireArtifacts = False,
) -> None:
    """Generate a continuation of PROMPT and print it."""
    from atomc.llm import LLM
    from atomc.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            stop=stop,
            seed=sample_seed,
        )
        cfg = config_from(locals())
        llm = LLM(config=cfg)
        outs = llm.chat([{"role": "user", "content": prompt}], params) if chat else llm.generate(prompt, params)
    except (ValueError, FileNotFoundError, ModuleNotFoundError, RuntimeError) as e:
        raise fail(str(e)) from None
    typer.echo(outs[0].outputs[0].text)


# -- serve -------------------------------------------------------------------------------------------


@app.command()
def serve(
    model: Model = None,
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port")] = 8000,
    api_key: Annotated[str | None, typer.Option("--api-key")] = None,
    served_model_name: Annotated[str | None, typer.Option("--served-model-name")] = None,
    chat_template: Annotated[str | None, typer.Option("--chat-template", help="jinja file or inline text")] = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    max_model_len: MaxModelLen = None,
    max_num_seqs: MaxNumSeqs = 256,
    max_num_batched_tokens: MaxBatchedTokens = 8192,
    block_size: BlockSize = 16,
    seed: Seed = 0,
    enforce_eager: EnforceEager = False,
    enable_prefix_caching: PrefixCaching = True,
    gpu_memory_utilization: GpuMem = 0.9,
    num_kv_blocks: KvBlocks = None,
    cache_dir: CacheDir = None,
    require_artifacts: RequireArtifacts = False,
    cudagraph_capture_sizes: CaptureSizes = None,
    cudagraph_mixed_max_tokens: MixedMaxTokens = 0,
    async_scheduling: AsyncScheduling = True,
    load_format: LoadFormat = "safetensors",
    generation_config: GenerationConfig = "auto",
    disable_pass: DisablePass = None,
    die_with_parent: Annotated[
        bool, typer.Option("--die-with-parent", help="exit when the process that started the server exits")
    ] = False,
    engine_process: Annotated[
        str,
        typer.Option(
            "--engine-process",
            help="auto | on | off: the engine loop in its own process (auto: on a GPU) or on a server thread",
        ),
    ] = "auto",
) -> None:
    """Serve an OpenAI-compatible API (completions, chat, models, health, metrics)."""
    from pathlib import Path

    from atomc.serve.server import run_server

    cfg = config_from(locals())
    cfg.serve.host, cfg.serve.port, cfg.serve.api_key = host, port, api_key
    cfg.serve.die_with_parent = die_with_parent
    cfg.serve.engine_process = engine_process
    cfg.model.served_model_name = served_model_name
    if chat_template is not None:
        path = Path(chat_template)
        cfg.serve.chat_template = path.read_text() if path.is_file() else chat_template
    try:
        code = run_server(cfg)
    except (ValueError, FileNotFoundError, ModuleNotFoundError, RuntimeError) as e:
        raise fail(str(e)) from None
    raise typer.Exit(code or 0)


# -- compile -----------------------------------------------------------------------------------------


@app.command("compile")
def compile_(
    model: Model = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    max_num_batched_tokens: MaxBatchedTokens = 8192,
    max_num_seqs: MaxNumSeqs = 256,
    max_model_len: MaxModelLen = None,
    cudagraph_capture_sizes: CaptureSizes = None,
    cache_dir: CacheDir = None,
    disable_pass: DisablePass = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Trace the model once, run atomc's passes, and write build artifacts into the cache."""
    from atomc.graphs.cli import compile_command

    cfg = config_from(locals())
    try:
        code = compile_command(cfg, as_json)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as e:
        raise fail(str(e)) from None
    raise typer.Exit(code or 0)


def _mount_subapps() -> None:
    try:
        from atomc.graphs.cli import cache_app

        app.add_typer(cache_app, name="cache", help="Inspect, verify and clear the compile cache.")
    except ImportError as e:  # keep the other commands usable if this part fails to import
        logging.getLogger(__name__).debug("atomc cache unavailable: %s", e)
    try:
        from atomc.serve.bench.cli import bench_app

        app.add_typer(bench_app, name="bench", help="Benchmark a running server; sweep CVS-style cells.")
    except ImportError as e:
        logging.getLogger(__name__).debug("atomc bench unavailable: %s", e)


_mount_subapps()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    sys.exit(main())
