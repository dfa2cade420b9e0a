"""A rank above 0 of a run that torchrun started (`--nnodes` > 1): the worker loop, without a driver
that spawned it.

On one machine the driver spawns its workers and hands each what it resolved (parallel_executor.py).
Across machines torchrun starts every rank, so a worker resolves the same things from the same
config and model folder the driver does (device, model files, dtype, context length), then runs
the worker loop of atomc/runtime/worker.py until the driver's STOP.
"""

from __future__ import annotations

from atomc.config import EngineConfig
from atomc.engine.model_files import resolve_model
from atomc.runtime.worker import WorkerArgs, run_launched


def run_launched_worker(config: EngineConfig, local_rank: int) -> None:
    m = resolve_model(config)
    run_launched(WorkerArgs(config, m.model_dir, m.arch, m.device, m.dtype, m.max_model_len, "env://", local_rank))
