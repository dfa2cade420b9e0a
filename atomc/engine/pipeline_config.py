"""What `--pipeline-parallel-size` > 1 runs with, said before any process starts.

The stages (atomc/runtime/stage_runner.py) run on one machine, one stage a process, each its own
compiled artifact (or the eager model with --enforce-eager), without tensor parallelism beside them;
everything else is refused here with the flag to change.
"""

from __future__ import annotations

from atomc.config import EngineConfig


def check_pipeline_config(config: EngineConfig) -> None:
    par = config.parallel
    pp = par.pipeline_parallel_size
    if par.tensor_parallel_size > 1:
        raise ValueError(
            f"--pipeline-parallel-size {pp} with --tensor-parallel-size {par.tensor_parallel_size}: tensor "
            "parallelism inside pipeline stages is not supported yet; use one of the two"
        )
    if par.enable_expert_parallel:
        raise ValueError(f"--pipeline-parallel-size {pp} with --enable-expert-parallel is not supported yet")
    if par.nnodes > 1:
        raise ValueError(f"--pipeline-parallel-size {pp} runs on one machine: --nnodes {par.nnodes} is not supported")
