"""What the engine's start-up builds beside the runner, and its log: the served model's name, the
KV block pools, and the runner's start-up phases."""

from __future__ import annotations

import logging
from pathlib import Path

from atomc.config import EngineConfig
from atomc.engine.block_manager import BlockManager
from models.loader.default_model import DEFAULT_MODEL_NAME

log = logging.getLogger(__name__)


def served_model_name(config: EngineConfig) -> str:
    """The `model` id the server lists: --served-model-name, else the checkpoint folder's (or .gguf
    file's) name, never a path of this machine; the default model goes by its own name."""
    if config.model.served_model_name:
        return config.model.served_model_name
    if not config.model.model:
        return DEFAULT_MODEL_NAME
    return Path(config.model.model).expanduser().name or DEFAULT_MODEL_NAME


def runner_phases(runner) -> str:
    """The model runner's start-up phases for the log (benchmarks/serve_start.py reads them)."""
    info, times = runner.compile_info, getattr(runner, "timings", {})
    parts = [f"imports {times.get('imports_s', 0.0):.1f}s (backend ops, compiler)"]
    weights = f"weights {times.get('load_weights_s', 0.0):.1f}s"
    if times.get("device_init_s"):
        weights += (
            f" (CUDA context {times['device_init_s']:.1f}s on a thread, overlapped with the imports; "
            f"{times.get('device_init_wait_s', 0.0):.1f}s waited)"
        )
    parts.append(weights)
    model = times.get("compile_or_load_s", 0.0)
    if not info:
        parts.append("model (eager) 0.0s")
    elif info.get("hit"):
        load = info.get("timings", {}).get("load_s", model)
        split = f"cache key and checks {model - load:.1f}s, load {load:.1f}s"
        parts.append(f"model (artifact loaded) {model:.1f}s ({split})")
    else:
        parts.append(f"model (compiled) {model:.1f}s")
    kv = times.get("kv_sizing_s", 0.0)
    parts.append(f"KV sizing {kv:.1f}s (on a GPU the first forward, with the kernels' first-use compiles)")
    if "warm_up_s" in times:
        parts.append(f"forwards at the smaller prefill sizes {times['warm_up_s']:.1f}s (their kernels' compiles)")
    return ", ".join(parts)


def block_pools(config: EngineConfig, runner, max_model_len: int) -> list[BlockManager]:
    """One block pool per KV-cache group of the model (full attention first), each able to hold
    one sequence of max_model_len (a windowed pool: its window and a chunk)."""
    cache, bs = config.cache, config.cache.block_size
    needs, _ = runner.kv_group_needs()
    pools = []
    for group, num_blocks, need in zip(runner.kv_groups, runner.group_num_blocks, needs, strict=True):
        window = group.sliding_window
        pool = BlockManager(num_blocks, bs, cache.enable_prefix_caching, sliding_window=window)
        if need > pool.num_usable_blocks:
            if window is None:
                raise ValueError(
                    f"the KV cache holds {pool.num_usable_blocks * bs} tokens, fewer than "
                    f"max_model_len={max_model_len}; lower --max-model-len or give the cache more memory"
                )
            raise ValueError(
                f"the KV cache of the layers with a {window}-token window holds {pool.num_usable_blocks} "
                f"blocks, fewer than the {need} one sequence needs (its window and a chunk of "
                f"max_num_batched_tokens={config.scheduler.max_num_batched_tokens}); lower "
                "--max-num-batched-tokens or give the cache more memory"
            )
        pools.append(pool)
    if len(pools) > 1:
        log.info(
            "KV-cache groups: %s",
            ", ".join(
                f"{'full' if g.sliding_window is None else f'window {g.sliding_window}'} "
                f"({len(g.layers)} layers, {p.num_usable_blocks} blocks)"
                for g, p in zip(runner.kv_groups, pools, strict=True)
            ),
        )
    return pools
