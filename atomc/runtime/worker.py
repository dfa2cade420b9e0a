"""One worker process (rank > 0): a ModelRunner on its rank (a TP shard or a pipeline stage).

The driver (the engine's process, rank 0) starts one per extra rank with the `spawn` start method
(atomc/engine/parallel_executor.py). The worker joins the ranks, builds its runner (its shard, its
compiled artifact keyed by rank and size, the KV pool the ranks agree on), reports ready on its
pipe, then loops: receive a step record (two broadcasts of int64 tensors over the gloo step
channel, atomc/runtime/step_codec.py), run its forward, receive the driver's sampled ids. A
pipeline stage (atomc/runtime/stage_runner.py) receives each record point-to-point instead, and
passes its hidden states on. It stops on the driver's STOP record, and exits on its own when the
driver's process is gone (a thread watches the parent pid), so no worker outlives its engine.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from atomc.config import EngineConfig
from atomc.runtime import distributed, step_codec

PARENT_POLL_S = 0.5


@dataclass
class WorkerArgs:
    """What one worker needs to start (pickled once, at spawn)."""

    config: EngineConfig  # its parallel.rank set to the worker's
    model_dir: Path
    arch: object  # models.arch.ModelArch
    device: str  # the engine's device ("cpu" or "cuda"); the worker's is rank_device(device, rank)
    dtype: torch.dtype
    max_model_len: int
    init_method: str
    local_rank: int | None = None  # its GPU on its machine (torchrun's LOCAL_RANK); None: its rank


def worker_main(args: WorkerArgs, ready) -> None:
    """The process entry: `ready` is the write end of a pipe (errors go there, then the exit code)."""
    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    logging.basicConfig(level=logging.WARNING)
    try:
        run_worker(args, ready)
    except BaseException as e:  # noqa: BLE001  (reported to the driver, then a non-zero exit)
        try:
            ready.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except OSError:
            pass
        sys.stderr.flush()
        os._exit(1)  # not through torch.distributed's teardown, which can wait on the other ranks
    distributed.leave()


def run_launched(args: WorkerArgs) -> None:
    """A rank that torchrun started (a multi-node run): no pipe to a driver; a failure is an
    exception, and torchrun ends the job's other ranks when this process exits non-zero."""
    try:
        run_worker(args, None)
    finally:
        distributed.leave()


def run_worker(args: WorkerArgs, ready) -> None:
    from atomc.runtime.stage_runner import runner_class  # in the child: torch and the kernels load here

    par = args.config.parallel
    rank, size = par.rank, distributed.world_size(par)
    device = distributed.rank_device(args.device, rank if args.local_rank is None else args.local_rank)
    if device == "cpu":  # the ranks share the cores: N ranks of all-core thread pools would thrash
        torch.set_num_threads(max(1, torch.get_num_threads() // size))
    channel = distributed.join(
        rank, size, device, args.init_method, par.distributed_timeout_s, par.tensor_parallel_size
    )
    info = distributed.parallel_info(par)
    cls = runner_class(info)
    runner = cls(args.config, args.model_dir, args.arch, device, args.dtype, args.max_model_len, info)
    if device.startswith("cuda") and not args.config.compile.enforce_eager:
        runner.capture_graphs(args.max_model_len)  # the driver captures the same sizes, in the same order
    if device.startswith("cuda"):
        from atomc.kernels.triton import compile_watch  # only where Triton kernels run

        compile_watch.start()  # from here a Triton compile is a stall: logged
    if ready is not None:
        ready.send(("ready", runner.group_num_blocks))
    if info.stages > 1:
        serve_stage_steps(runner, channel)
    else:
        serve_steps(runner, channel)


def serve_steps(runner, channel: dist.ProcessGroup) -> None:
    """Run the driver's step records until it sends STOP."""
    head = torch.empty(step_codec.HEADER_LEN, dtype=torch.int64)
    while True:
        dist.broadcast(head, src=0, group=channel)
        kind, length = head.tolist()
        if kind == step_codec.STOP:
            return
        payload = torch.empty(length, dtype=torch.int64)
        dist.broadcast(payload, src=0, group=channel)
        runner.launch(step_codec.decode(payload))  # no result: rank 0 samples


def serve_stage_steps(runner, channel: dist.ProcessGroup) -> None:
    """A pipeline stage: run the driver's step records, sent to this rank alone (the stages work
    on different steps at once, so no collective over all ranks), until it sends STOP."""
    head = torch.empty(step_codec.HEADER_LEN, dtype=torch.int64)
    while True:
        dist.recv(head, src=0, group=channel)
        kind, length = head.tolist()
        if kind == step_codec.STOP:
            runner.sends.flush()
            return
        payload = torch.empty(length, dtype=torch.int64)
        dist.recv(payload, src=0, group=channel)
        runner.launch(step_codec.decode(payload))  # no result: the driver samples


def _exit_with_parent(parent: int) -> None:
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent:  # re-parented: the driver is gone
            os._exit(3)
