"""`atomc` command line: compile | serve | generate | cache | bench. Flags map onto EngineConfig."""

from __future__ import annotations

import logging
import sys
from typing import Annotated

import typer

from atomc.cli.flags import (
    AsyncScheduling,
    BlockSize,
    CacheDir,
    CaptureSizes,
    Device,
    DisablePass,
    Dtype,
    EnableExpertParallel,
    EnablePdl,
    EnforceEager,
    GenerationConfig,
    GpuMem,
    KvBlocks,
    KvCacheDtype,
    LoadFormat,
    MasterAddr,
    MasterPort,
    MaxBatchedTokens,
    MaxModelLen,
    MaxNumSeqs,
    MixedMaxTokens,
    Model,
    NNodes,
    NodeRank,
    OneShotAllReduce,
    PipelineParallelSize,
    PrefixCaching,
    Quantization,
    RequireArtifacts,
    Seed,
    SigningKeyFile,
    TensorParallelSize,
    config_from,
    fail,
)
from atomc.cli.launch import run_as_rank
from atomc.config import (
    CacheConfig,
    CompileConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    ServeConfig,
)

# plain click help (rich_markup_mode=None): rich's boxed tables cut long flag names at 80 columns
HELP_SETTINGS = {"max_content_width": 120, "help_option_names": ["-h", "--help"]}
app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings=HELP_SETTINGS,
    help="atomc: compile a model once, then serve it fast.",
)

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
    device: Device = EngineConfig.device,
    dtype: Dtype = ModelConfig.dtype,
    quantization: Quantization = None,
    kv_cache_dtype: KvCacheDtype = CacheConfig.kv_cache_dtype,
    max_model_len: MaxModelLen = None,
    seed: Seed = ModelConfig.seed,
    enforce_eager: EnforceEager = CompileConfig.enforce_eager,
    cache_dir: CacheDir = None,
    cache_signing_key_file: SigningKeyFile = None,
    require_artifacts: RequireArtifacts = CompileConfig.require_artifacts,
    tensor_parallel_size: TensorParallelSize = ParallelConfig.tensor_parallel_size,
    pipeline_parallel_size: PipelineParallelSize = ParallelConfig.pipeline_parallel_size,
    enable_expert_parallel: EnableExpertParallel = ParallelConfig.enable_expert_parallel,
    one_shot_all_reduce: OneShotAllReduce = ParallelConfig.one_shot_all_reduce,
    nnodes: NNodes = ParallelConfig.nnodes,
    node_rank: NodeRank = ParallelConfig.node_rank,
    master_addr: MasterAddr = ParallelConfig.master_addr,
    master_port: MasterPort = ParallelConfig.master_port,
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
        if run_as_rank(cfg):  # a worker rank of a multi-node run: it served until the engine stopped
            return
        llm = LLM(config=cfg)
        outs = llm.chat([{"role": "user", "content": prompt}], params) if chat else llm.generate(prompt, params)
    except (ValueError, FileNotFoundError, ModuleNotFoundError, RuntimeError) as e:
        raise fail(str(e)) from None
    typer.echo(outs[0].outputs[0].text)


# -- serve -------------------------------------------------------------------------------------------


@app.command()
def serve(
    model: Model = None,
    host: Annotated[str, typer.Option("--host")] = ServeConfig.host,
    port: Annotated[int, typer.Option("--port")] = ServeConfig.port,
    api_key: Annotated[str | None, typer.Option("--api-key")] = None,
    served_model_name: Annotated[str | None, typer.Option("--served-model-name")] = None,
    chat_template: Annotated[str | None, typer.Option("--chat-template", help="jinja file or inline text")] = None,
    device: Device = EngineConfig.device,
    dtype: Dtype = ModelConfig.dtype,
    quantization: Quantization = None,
    kv_cache_dtype: KvCacheDtype = CacheConfig.kv_cache_dtype,
    max_model_len: MaxModelLen = None,
    max_num_seqs: MaxNumSeqs = SchedulerConfig.max_num_seqs,
    max_num_batched_tokens: MaxBatchedTokens = SchedulerConfig.max_num_batched_tokens,
    block_size: BlockSize = CacheConfig.block_size,
    seed: Seed = ModelConfig.seed,
    enforce_eager: EnforceEager = CompileConfig.enforce_eager,
    enable_prefix_caching: PrefixCaching = CacheConfig.enable_prefix_caching,
    gpu_memory_utilization: GpuMem = CacheConfig.gpu_memory_utilization,
    num_kv_blocks: KvBlocks = None,
    cache_dir: CacheDir = None,
    cache_signing_key_file: SigningKeyFile = None,
    require_artifacts: RequireArtifacts = CompileConfig.require_artifacts,
    cudagraph_capture_sizes: CaptureSizes = None,
    cudagraph_mixed_max_tokens: MixedMaxTokens = CompileConfig.cudagraph_mixed_max_tokens,
    enable_pdl: EnablePdl = CompileConfig.enable_pdl,
    async_scheduling: AsyncScheduling = SchedulerConfig.async_scheduling,
    load_format: LoadFormat = ModelConfig.load_format,
    generation_config: GenerationConfig = ModelConfig.generation_config,
    disable_pass: DisablePass = None,
    tensor_parallel_size: TensorParallelSize = ParallelConfig.tensor_parallel_size,
    pipeline_parallel_size: PipelineParallelSize = ParallelConfig.pipeline_parallel_size,
    enable_expert_parallel: EnableExpertParallel = ParallelConfig.enable_expert_parallel,
    one_shot_all_reduce: OneShotAllReduce = ParallelConfig.one_shot_all_reduce,
    nnodes: NNodes = ParallelConfig.nnodes,
    node_rank: NodeRank = ParallelConfig.node_rank,
    master_addr: MasterAddr = ParallelConfig.master_addr,
    master_port: MasterPort = ParallelConfig.master_port,
    die_with_parent: Annotated[
        bool, typer.Option("--die-with-parent", help="exit when the process that started the server exits")
    ] = ServeConfig.die_with_parent,
    engine_process: Annotated[
        str,
        typer.Option(
            "--engine-process",
            help="auto | on | off: the engine loop in its own process (auto: on a GPU) or on a server thread",
        ),
    ] = ServeConfig.engine_process,
    max_prompts_per_request: Annotated[
        int, typer.Option("--max-prompts-per-request", help="prompts in one completions request")
    ] = ServeConfig.max_prompts_per_request,
    max_seqs_per_request: Annotated[
        int, typer.Option("--max-seqs-per-request", help="sequences one request fans out to (prompts x n)")
    ] = ServeConfig.max_seqs_per_request,
    max_logprob_entries_per_request: Annotated[
        int,
        typer.Option(
            "--max-logprob-entries-per-request",
            help="logprob entries one response may carry: tokens (echoed prompts included) x (logprobs + 1)",
        ),
    ] = ServeConfig.max_logprob_entries_per_request,
    max_request_bytes: Annotated[
        int, typer.Option("--max-request-bytes", help="request body size limit (413 past it)")
    ] = ServeConfig.max_request_bytes,
    request_body_timeout: Annotated[
        float, typer.Option("--request-body-timeout", help="seconds to receive a body (408 past it)")
    ] = ServeConfig.request_body_timeout_s,
    request_header_timeout: Annotated[
        float, typer.Option("--request-header-timeout", help="seconds to receive a request's headers (408 past it)")
    ] = ServeConfig.request_header_timeout_s,
    timeout_keep_alive: Annotated[
        int, typer.Option("--timeout-keep-alive", help="seconds an idle keep-alive connection stays open")
    ] = ServeConfig.timeout_keep_alive_s,
    drain_timeout: Annotated[
        float, typer.Option("--drain-timeout", help="seconds in-flight requests may finish after SIGTERM")
    ] = ServeConfig.drain_timeout_s,
    enable_auto_tool_choice: Annotated[
        bool,
        typer.Option("--enable-auto-tool-choice", help='let the model choose tool calls (tool_choice "auto")'),
    ] = ServeConfig.enable_auto_tool_choice,
    tool_call_parser: Annotated[
        str | None,
        typer.Option("--tool-call-parser", help="hermes | llama3_json | mistral | deepseek_v3 | openai"),
    ] = None,
    reasoning_parser: Annotated[
        str | None,
        typer.Option("--reasoning-parser", help="deepseek_r1 | qwen3 | openai: reasoning_content apart"),
    ] = None,
    disable_uvicorn_access_log: Annotated[
        bool, typer.Option("--disable-uvicorn-access-log", help="no access log lines at all")
    ] = ServeConfig.disable_uvicorn_access_log,
    disable_access_log_for_endpoints: Annotated[
        str | None,
        typer.Option(
            "--disable-access-log-for-endpoints",
            help="comma-separated paths whose requests are not access-logged, e.g. /health,/metrics",
        ),
    ] = None,
) -> None:
    """Serve an OpenAI-compatible API (completions, chat, models, health, metrics)."""
    from pathlib import Path

    from atomc.serve.access_log import parse_endpoints
    from atomc.serve.server import run_server

    cfg = config_from(locals())
    try:
        if run_as_rank(cfg):  # a worker rank of a multi-node run: it served until the engine stopped
            return
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise fail(str(e)) from None
    cfg.serve.host, cfg.serve.port, cfg.serve.api_key = host, port, api_key
    cfg.serve.die_with_parent = die_with_parent
    cfg.serve.engine_process = engine_process
    cfg.serve.max_prompts_per_request = max_prompts_per_request
    cfg.serve.max_seqs_per_request = max_seqs_per_request
    cfg.serve.max_logprob_entries_per_request = max_logprob_entries_per_request
    cfg.serve.max_request_bytes = max_request_bytes
    cfg.serve.request_body_timeout_s = request_body_timeout
    cfg.serve.request_header_timeout_s = request_header_timeout
    cfg.serve.timeout_keep_alive_s = timeout_keep_alive
    cfg.serve.drain_timeout_s = drain_timeout
    cfg.serve.enable_auto_tool_choice = enable_auto_tool_choice
    cfg.serve.tool_call_parser, cfg.serve.reasoning_parser = tool_call_parser, reasoning_parser
    cfg.serve.disable_uvicorn_access_log = disable_uvicorn_access_log
    try:
        cfg.serve.disable_access_log_for_endpoints = parse_endpoints(disable_access_log_for_endpoints)
    except ValueError as e:
        raise fail(str(e)) from None
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
    device: Device = EngineConfig.device,
    dtype: Dtype = ModelConfig.dtype,
    quantization: Quantization = None,
    kv_cache_dtype: KvCacheDtype = CacheConfig.kv_cache_dtype,
    max_num_batched_tokens: MaxBatchedTokens = SchedulerConfig.max_num_batched_tokens,
    max_num_seqs: MaxNumSeqs = SchedulerConfig.max_num_seqs,
    max_model_len: MaxModelLen = None,
    cudagraph_capture_sizes: CaptureSizes = None,
    cache_dir: CacheDir = None,
    cache_signing_key_file: SigningKeyFile = None,
    disable_pass: DisablePass = None,
    tensor_parallel_size: TensorParallelSize = ParallelConfig.tensor_parallel_size,
    pipeline_parallel_size: PipelineParallelSize = ParallelConfig.pipeline_parallel_size,
    enable_expert_parallel: EnableExpertParallel = ParallelConfig.enable_expert_parallel,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Trace the model once, run atomc's passes, and write build artifacts into the cache (with
    --tensor-parallel-size N: each rank's, in N processes, as `serve -tp N` will look them up; with
    --pipeline-parallel-size P each stage's, in P processes, for `serve -pp P`)."""
    from atomc.cli.cache import compile_command

    cfg = config_from(locals())
    try:
        code = compile_command(cfg, as_json)
    except (ValueError, FileNotFoundError, ModuleNotFoundError, RuntimeError) as e:
        raise fail(str(e)) from None
    raise typer.Exit(code or 0)


def _mount_subapps() -> None:
    try:
        from atomc.cli.cache import cache_app

        app.add_typer(cache_app, name="cache", help="Inspect, verify and clear the compile cache.")
    except ImportError as e:  # keep the other commands usable if this part fails to import
        logging.getLogger(__name__).debug("atomc cache unavailable: %s", e)
    try:
        from atomc.bench.cli import bench_app

        app.add_typer(bench_app, name="bench", help="Benchmark a running server; sweep CVS-style cells.")
    except ImportError as e:
        logging.getLogger(__name__).debug("atomc bench unavailable: %s", e)


_mount_subapps()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    sys.exit(main())
