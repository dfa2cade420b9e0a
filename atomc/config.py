"""The one config tree. Every CLI flag maps onto a field here; nothing else switches behaviour.

Names follow vLLM's flags where one exists (`max_model_len` <- `--max-model-len`, ...).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from atomc import env


@dataclass
class ModelConfig:
    model: str | None = None  # checkpoint dir or .gguf file; None = the default model
    tokenizer: str | None = None  # defaults to the model dir
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    max_model_len: int | None = None  # None = the checkpoint's max_position_embeddings
    seed: int = 0
    served_model_name: str | None = None
    load_format: str = "safetensors"  # safetensors | dummy (random weights; for benchmarks)
    # fp8: quantise an unquantised checkpoint at load (per-channel weights, dynamic per-token
    # activations); None: as the checkpoint is (its quantization_config, if any). A graph factor.
    quantization: str | None = None
    # auto: the checkpoint's generation_config.json supplies default sampling values (as vLLM does);
    # none: atomc's own defaults (temperature 1, top_p 1, ...)
    generation_config: str = "auto"


@dataclass
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    # KV pool size: explicit block count wins; else a share of free accelerator memory; on CPU a fixed budget
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = 1.0
    # auto = the model dtype; fp8 (or fp8_e4m3): e4m3 pages with per-layer k/v scales (docs/quantization.md)
    kv_cache_dtype: str = "auto"


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    # schedule and launch step N+1 before reading step N's sampled tokens back (they reach the GPU
    # inputs on the GPU), so the host work of a step overlaps the GPU work of the one before it
    async_scheduling: bool = True


@dataclass
class CompileConfig:
    enforce_eager: bool = False  # True: never compile, run the eager model
    cache_dir: str = field(default_factory=lambda: str(env.cache_dir()))
    cudagraph_capture_sizes: list[int] | None = None  # None = the default ladder up to max_num_seqs
    # mixed (prefill + decode) batches up to this many tokens replay full CUDA graphs (CUDA only);
    # 0 = never. Off: no serving gain measured on the H200 (docs/performance.md, section 2)
    cudagraph_mixed_max_tokens: int = 0
    # Triton kernels launch with programmatic dependent launch on Hopper and later (CUDA only;
    # atomc/kernels/triton/pdl.py): each starts while the one before it finishes. How kernels are
    # launched, not what the graph holds: not a key factor
    enable_pdl: bool = True
    disabled_passes: list[str] = field(default_factory=list)
    require_artifacts: bool = False  # fail instead of compiling on a cache miss
    # the key that signs and verifies cache entries (graphs/signing.py); None: the environment's
    # ATOMC_CACHE_SIGNING_KEY_FILE, else a per-user key in atomc's config folder. Not a key factor
    cache_signing_key_file: str | None = None


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1  # ranks: the engine's process is rank 0, each other a worker process
    # pipeline stages of tensor_parallel_size processes each (this one is stage 0, tp rank 0); world rank =
    # stage * tensor_parallel_size + tp rank; each rank its own artifact (parallelism.md)
    pipeline_parallel_size: int = 1
    # MoE layers give each rank whole experts instead of a slice of every expert (attention stays TP)
    enable_expert_parallel: bool = False
    # CUDA: the fused all-reduce + add + RMSNorm as one kernel over symmetric memory instead of NCCL
    # then the add + norm (parallelism.md; opt-in: never run on GPUs). Runtime only: not a key factor
    one_shot_all_reduce: bool = False
    rank: int = 0  # this process's world rank (set per worker; its stage and tp rank are cache-key factors)
    # several machines (vLLM's names): torchrun starts tp x pp / nnodes ranks on each
    # node, joined at master_addr:master_port; node 0's rank 0 is the engine (docs/parallelism.md)
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    # torch.distributed's timeout for every collective: a rank that stops answering fails the others
    distributed_timeout_s: float = 300.0


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    chat_template: str | None = None
    max_request_bytes: int = 8 * 1024 * 1024
    # bounded work per request (400 past each): prompts in one completions request, sequences it
    # fans out to (prompts x n), and logprob entries its response can carry (tokens x (logprobs + 1),
    # echoed prompt tokens included; about 40 bytes of JSON each)
    max_prompts_per_request: int = 256
    max_seqs_per_request: int = 1024
    max_logprob_entries_per_request: int = 1_000_000
    request_body_timeout_s: float = 30.0  # to receive a whole body once its headers are in (408 past it)
    request_header_timeout_s: float = 20.0  # to receive a request's header block (408 and close past it)
    timeout_keep_alive_s: int = 5  # idle keep-alive connections close after this (uvicorn's)
    max_header_bytes: int = 64 * 1024  # one request's header block (h11's incomplete-event limit)
    drain_timeout_s: float = 30.0
    die_with_parent: bool = False  # SIGTERM when the parent process exits (harnesses that spawn a server)
    # the engine loop in its own process (HTTP/SSE work then never holds the GIL the engine needs):
    # "on", "off", or "auto" = on when the engine runs on a GPU (see docs/serving.md for why not on CPU)
    engine_process: str = "auto"
    # tool calls and reasoning output (vLLM's flags; atomc/serve/tool_parsers, reasoning_parsers):
    # tool_choice "auto" (the default when a request has tools) needs both of the first two
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # hermes | llama3_json | mistral | deepseek_v3 | openai
    reasoning_parser: str | None = None  # deepseek_r1 | qwen3 | openai
    # access-log noise (vLLM's flags): no access log at all, or none for these paths (health probes)
    disable_uvicorn_access_log: bool = False
    disable_access_log_for_endpoints: list[str] = field(default_factory=list)


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    device: str = "auto"  # auto | cpu | cuda | cuda:N

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def update(self, **values) -> EngineConfig:
        """Set fields by their own name (`max_num_seqs=64` sets `scheduler.max_num_seqs`): how CLI
        flags and `LLM(...)` keywords map onto the tree. Every field name is unique across sections."""
        for name, value in values.items():
            if name == "device":
                self.device = value
                continue
            section = _FIELD_SECTION.get(name)
            if section is None:
                raise TypeError(f"EngineConfig has no field {name!r}")
            setattr(getattr(self, section), name, value)
        return self

    @property
    def cache_path(self) -> Path:
        return Path(self.compile.cache_dir).expanduser()


# section name -> its dataclass, from EngineConfig itself
_SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(EngineConfig) if f.name != "device"}
_FIELD_SECTION = {f.name: section for section, cls in _SECTIONS.items() for f in dataclasses.fields(cls)}
assert len(_FIELD_SECTION) == sum(len(dataclasses.fields(c)) for c in _SECTIONS.values()), "field names must be unique"


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name} was asked for, but this torch sees no CUDA device")
    return name


DTYPES = ("float32", "float16", "bfloat16")


def resolve_dtype(name: str, checkpoint_dtype: str, device: str):
    """The torch dtype for `--dtype name`: auto takes the checkpoint's dtype on a GPU (bf16 for an
    fp32 checkpoint) and float32 on the CPU (its half-precision matmuls are slow and less exact)."""
    import torch

    if name == "auto":
        if not device.startswith("cuda"):
            return torch.float32
        return getattr(torch, checkpoint_dtype) if checkpoint_dtype in ("float16", "bfloat16") else torch.bfloat16
    if name not in DTYPES:
        raise ValueError(f"--dtype {name!r} is not one of: auto, {', '.join(DTYPES)}")
    return getattr(torch, name)
