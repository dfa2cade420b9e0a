"""The engine flags (vLLM's names) every `atomc` command shares, and how they become an EngineConfig.

One Annotated option type per flag, so `compile`, `serve`, `generate` and `cache explain` declare a
flag the same way; `build_config` maps the parsed values onto the config tree by field name.
"""

from __future__ import annotations

from typing import Annotated

import typer

from atomc.config import EngineConfig

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
SigningKeyFile = Annotated[
    str | None,
    typer.Option(
        "--cache-signing-key-file",
        help="key that signs and verifies compile cache entries (default: ~/.config/atomc/cache-signing.key)",
    ),
]
RequireArtifacts = Annotated[
    bool, typer.Option("--require-artifacts", help="fail on a compile-cache miss instead of compiling")
]
GpuMem = Annotated[float, typer.Option("--gpu-memory-utilization")]
KvCacheDtype = Annotated[
    str,
    typer.Option("--kv-cache-dtype", help="auto (the model dtype) | fp8 (e4m3 with per-layer scales; fp8_e4m3 too)"),
]
KvBlocks = Annotated[int | None, typer.Option("--num-kv-blocks", help="KV pool size in blocks (overrides sizing)")]
CaptureSizes = Annotated[
    str | None, typer.Option("--cudagraph-capture-sizes", help="comma-separated batch sizes, e.g. 1,2,4,8")
]
MixedMaxTokens = Annotated[
    int,
    typer.Option(
        "--cudagraph-mixed-max-tokens",
        help="CUDA graphs for mixed (prefill + decode) batches up to N tokens; 0: off",
    ),
]
AsyncScheduling = Annotated[
    bool,
    typer.Option(
        "--async-scheduling/--no-async-scheduling",
        help="launch each step before the previous step's tokens are read back (default on)",
    ),
]
EnablePdl = Annotated[
    bool,
    typer.Option(
        "--enable-pdl/--no-enable-pdl",
        help="CUDA, Hopper and later: each kernel starts while the one before it finishes (default on)",
    ),
]
GenerationConfig = Annotated[
    str, typer.Option("--generation-config", help="auto: sampling defaults from generation_config.json; none")
]
LoadFormat = Annotated[str, typer.Option("--load-format", help="safetensors | dummy (random weights)")]
Quantization = Annotated[
    str | None,
    typer.Option(
        "--quantization", "-q", help="fp8: quantise a bf16/fp32 checkpoint at load (default: as the checkpoint is)"
    ),
]
TensorParallelSize = Annotated[
    int, typer.Option("--tensor-parallel-size", "-tp", help="ranks the model is split over (one process each)")
]
PipelineParallelSize = Annotated[
    int,
    typer.Option(
        "--pipeline-parallel-size",
        "-pp",
        help="pipeline stages (x -tp ranks each), each rank its own artifact; with --nnodes, over machines",
    ),
]
EnableExpertParallel = Annotated[
    bool,
    typer.Option("--enable-expert-parallel", help="MoE layers: whole experts per rank instead of a slice of each"),
]
OneShotAllReduce = Annotated[
    bool,
    typer.Option(
        "--one-shot-all-reduce",
        help="CUDA, -tp > 1: all-reduce + add + RMSNorm in one kernel over symmetric memory (experimental)",
    ),
]
NNodes = Annotated[int, typer.Option("--nnodes", help="machines the ranks span (torchrun starts them on each)")]
NodeRank = Annotated[int, typer.Option("--node-rank", help="this machine's index among --nnodes")]
MasterAddr = Annotated[str, typer.Option("--master-addr", help="node 0's address, where the ranks meet")]
MasterPort = Annotated[int, typer.Option("--master-port", help="node 0's port, where the ranks meet")]
DisablePass = Annotated[list[str] | None, typer.Option("--disable-pass", help="skip a compiler pass by name")]


# the engine flags a command may declare; each sets the EngineConfig field of the same name
# (disable_pass -> compile.disabled_passes); a flag a command does not declare keeps the config default
_CONFIG_FLAGS = frozenset(
    {
        "model", "device", "dtype", "max_model_len", "seed", "load_format", "generation_config", "quantization",
        "max_num_seqs", "max_num_batched_tokens", "async_scheduling",
        "block_size", "enable_prefix_caching", "gpu_memory_utilization", "num_kv_blocks", "kv_cache_dtype",
        "enforce_eager", "cache_dir", "cache_signing_key_file", "require_artifacts", "cudagraph_capture_sizes",
        "cudagraph_mixed_max_tokens", "enable_pdl", "disable_pass",
        "tensor_parallel_size", "pipeline_parallel_size", "enable_expert_parallel", "one_shot_all_reduce",
        "nnodes", "node_rank", "master_addr", "master_port",
    }
)  # fmt: skip


def build_config(**flags) -> EngineConfig:
    """An EngineConfig from engine flags as the CLI parses them."""
    unknown = set(flags) - _CONFIG_FLAGS
    assert not unknown, f"not engine flags: {sorted(unknown)}"
    if flags.get("cache_dir") is None:
        flags.pop("cache_dir", None)  # None: the config's default location
    if "cudagraph_capture_sizes" in flags:
        sizes = flags["cudagraph_capture_sizes"]
        flags["cudagraph_capture_sizes"] = parse_sizes(sizes) if sizes else None
    if "disable_pass" in flags:
        flags["disabled_passes"] = list(flags.pop("disable_pass") or [])
    return EngineConfig().update(**flags)


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
