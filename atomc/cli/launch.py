"""Several machines through torchrun: `--nnodes N --node-rank R --master-addr A --master-port P`.

atomc does not start remote processes itself. With `--nnodes` > 1 the command, run once on each
node, replaces itself with torchrun (`python -m torch.distributed.run`), which starts
tensor_parallel_size x pipeline_parallel_size / nnodes ranks on that node, each running the same
command; torchrun sets RANK / LOCAL_RANK / WORLD_SIZE and the rendezvous at A:P. torchrun gives node
n the ranks n * k .. n * k + k - 1 (k a node), and a stage's tensor-parallel ranks are neighbours
(world rank = stage * T + tensor-parallel rank), so with `-tp T -pp P --nnodes P` each node holds
one stage: the all-reduces stay inside a machine, the stage-to-stage sends cross them. Inside it,
global rank 0 is the engine (it schedules, samples and, for `serve`, answers HTTP); every other rank
runs the worker loop (a pipeline stage's, past stage 0) until the engine stops. torchrun also ends
every rank of the job when one of them fails.
"""

from __future__ import annotations

import os
import sys

from atomc import env
from atomc.config import EngineConfig


def torchrun_argv(cfg: EngineConfig, command: list[str]) -> list[str]:
    """The torchrun command that runs `command` (atomc's own argv, without the program) on this node."""
    par = cfg.parallel
    world = par.tensor_parallel_size * par.pipeline_parallel_size
    if world % par.nnodes:
        asked = f"--tensor-parallel-size {par.tensor_parallel_size}"
        if par.pipeline_parallel_size > 1:
            asked += f" x --pipeline-parallel-size {par.pipeline_parallel_size} = {world} ranks"
        raise ValueError(f"{asked} does not divide across --nnodes {par.nnodes}")
    if not 0 <= par.node_rank < par.nnodes:
        raise ValueError(f"--node-rank {par.node_rank} is not a node of --nnodes {par.nnodes}")
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={par.nnodes}", f"--node-rank={par.node_rank}",
        f"--nproc-per-node={world // par.nnodes}",
        f"--master-addr={par.master_addr}", f"--master-port={par.master_port}",
        "-m", "atomc.cli", *command,
    ]  # fmt: skip


def run_as_rank(cfg: EngineConfig) -> bool:
    """Where this process stands in a multi-node run. Returns False when the command should run as
    usual (one node; or rank 0 under torchrun); True when this process was a worker rank and has
    finished. Outside torchrun with --nnodes > 1 it execs torchrun and does not return."""
    par = cfg.parallel
    launched = env.launched_rank(par.tensor_parallel_size * par.pipeline_parallel_size)
    if launched is None:
        if par.nnodes == 1:
            return False
        argv = torchrun_argv(cfg, sys.argv[1:])
        sys.stdout.flush()
        os.execv(argv[0], argv)
    rank, local_rank, _ = launched
    par.rank = rank
    if rank == 0:
        return False
    from atomc.engine.launched_worker import run_launched_worker

    run_launched_worker(cfg, local_rank)
    return True
