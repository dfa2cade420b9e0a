"""A rank above 0 of a run that torchrun started (`--nnodes` > 1): the worker loop, without a driver
that spawned it.

On one machine the driver spawns its workers and hands each what it resolved (parallel_executor.py).
Across machines torchrun starts every rank, so a worker resolves the same things from the same
config and model folder the driver does (device, model files, dtype, context length), then runs
the worker loop of atomc/runtime/worker.py until the driver's STOP.
"""

from __future__ import annotations

from atomc.config import EngineConfig, resolve_device, resolve_dtype
from atomc.engine.llm_engine import max_model_len
from atomc.runtime.worker import WorkerArgs, run_launched
from models.arch import ModelArch
from models.loader.default_model import resolve_model_path


def run_launched_worker(config: EngineConfig, local_rank: int) -> None:
    device = resolve_device(config.device)
    model_dir = resolve_model_path(config.model.model, config.cache_path)
    arch = ModelArch.from_dir(model_dir)
    dtype = resolve_dtype(config.model.dtype, arch.torch_dtype, device)
    args = WorkerArgs(config, model_dir, arch, device, dtype, max_model_len(arch, config), "env://", local_rank)
    run_launched(args)
