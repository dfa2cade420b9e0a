"""The driver's side of tensor and pipeline parallelism: start the workers, send them each step, watch them.

With `--tensor-parallel-size N` the engine's own process is rank 0 (it schedules and is the only
rank that samples) and N - 1 worker processes (atomc/runtime/worker.py, started with `spawn`) are
ranks 1..N-1. `start` spawns them and joins the ranks with them; the engine then builds its own
runner (rank 0) while the workers build theirs, and `wait_ready` collects their start-up errors.
Each step `send(step)` broadcasts the record as int64 tensors (atomc/runtime/step_codec.py) before
the driver's own forward. With `--pipeline-parallel-size P` rank s is pipeline stage s (the driver
stage 0), and `send` sends the record to each stage point-to-point and asynchronously, since the
stages work on different steps at once (atomc/runtime/stage_runner.py). With both (`-tp T -pp P`)
the world is T x P ranks, world rank = stage * T + tensor-parallel rank, and every rank but the
driver gets the record point-to-point, each stage's tensor-parallel ranks alike.

Failure: a worker that dies ends the engine with `WorkerDied` (which worker, its exit code, its
error if it sent one), not a hang: `send` checks every worker's process first, and a watchdog
thread that sees a worker's sentinel fire while a collective waits on it kills the whole group of
workers so the collective fails at once (gloo and NCCL also give up after the distributed
timeout). `close` stops them (a STOP record, then a join, then a kill); an `atexit` hook does it
for an engine nobody closed, and each worker exits by itself when the driver's process is gone.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import signal
import threading
import time
from multiprocessing.connection import wait

import torch.distributed as dist

from atomc import env
from atomc.config import EngineConfig
from atomc.runtime import distributed, step_codec
from atomc.runtime.batch import StepInput
from atomc.runtime.stage_io import Sends
from atomc.runtime.worker import WorkerArgs, worker_main

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10.0  # a worker that does not stop after STOP is killed
FAILURE_REAP_S = 2.0  # after a failed step: how long a worker's exit may take to show


class WorkerDied(RuntimeError):
    """A worker (a tensor-parallel rank or a pipeline stage) exited: the engine cannot run another step."""


class ParallelExecutor:
    def __init__(self, config: EngineConfig, model_dir, arch, device: str, dtype, max_model_len: int):
        par = config.parallel
        self.size = distributed.world_size(par)
        # pipeline stages each get their step record alone (they work on different steps at once)
        self.pipeline = par.pipeline_parallel_size > 1
        self.kind = "pipeline-stage" if self.pipeline else "tensor-parallel"
        self._record_sends = Sends()
        launched = env.launched_rank(self.size)  # torchrun started every rank: nothing to spawn
        distributed.check_world(device, self.size // par.nnodes, distributed.world_flags(par))
        self._tp_size = par.tensor_parallel_size
        ctx = mp.get_context("spawn")
        init = "env://" if launched is not None else distributed.local_init_method()
        self.procs: list[mp.process.BaseProcess] = []
        self.pipes = []
        for rank in range(1, self.size) if launched is None else ():
            cfg = _with_rank(config, rank)
            args = WorkerArgs(cfg, model_dir, arch, device, dtype, max_model_len, init)
            recv, send = ctx.Pipe(duplex=False)
            name = f"atomc-{'pp-stage' if self.pipeline else 'tp-worker'}-{rank}"
            proc = ctx.Process(target=worker_main, args=(args, send), name=name)
            proc.start()
            send.close()
            self.procs.append(proc)
            self.pipes.append(recv)
        self._closed = False
        self._errors: dict[int, str] = {}
        # the worker the watchdog saw exit first: the one to blame, not the others it then killed
        self._first_dead: int | None = None
        atexit.register(self.close)
        try:
            rank0 = distributed.rank_device(device, 0)
            self.channel = distributed.join(
                0, self.size, rank0, init, par.distributed_timeout_s, par.tensor_parallel_size
            )
        except BaseException:
            self.close()
            raise
        self._stop_watch = threading.Event()
        self._watchdog: threading.Thread | None = None
        if self.procs:  # torchrun's ranks are torchrun's to watch: it ends the job when one fails
            self._watchdog = threading.Thread(target=self._watch, daemon=True, name="atomc-worker-watchdog")
            self._watchdog.start()

    # -- start-up ------------------------------------------------------------------------------------

    def wait_ready(self, num_blocks: list[int]) -> None:
        """Wait for every worker's runner; each must have sized the same KV pools as the driver."""
        for rank, pipe in enumerate(self.pipes, 1):
            kind, value = self._receive(rank, pipe)
            if kind != "ready":
                raise self._died(rank)
            if value != num_blocks:
                raise RuntimeError(f"worker rank {rank} sized KV pools {value}, the driver {num_blocks}")

    def _receive(self, rank: int, pipe):
        try:
            return pipe.recv()
        except EOFError:
            raise self._died(rank) from None

    # -- each step -----------------------------------------------------------------------------------

    def send(self, step: StepInput) -> None:
        self.check_alive()
        payload = step_codec.encode(step)
        head = step_codec.header(step_codec.STEP, payload)
        if self.pipeline:  # asynchronous: a stage may still be running earlier steps
            for rank in range(1, self.size):
                self._record_sends.send(head, rank, self.channel)
                self._record_sends.send(payload, rank, self.channel)
            return
        dist.broadcast(head, src=0, group=self.channel)
        dist.broadcast(payload, src=0, group=self.channel)

    def _send_stop(self) -> None:
        head = step_codec.header(step_codec.STOP)
        if not self.pipeline:
            dist.broadcast(head, src=0, group=self.channel)
            return
        for rank in range(1, self.size):
            self._record_sends.send(head, rank, self.channel)
        self._record_sends.flush()

    def failure(self, error: BaseException) -> BaseException:
        """What ends the engine after `error` in a step or at start-up (the ranks may be out of
        step, so nothing runs again): a dead worker's WorkerDied if there is one, else `error`.
        The driver's own configuration errors (a size that does not divide, a missing file) stay
        themselves: the workers hit the same one."""
        if isinstance(error, (ValueError, TypeError, FileNotFoundError)):
            self.close(graceful=False)
            return error
        # one thread reaps the workers from here on: a waitpid racing the watchdog's can report a
        # dead worker alive
        self._stop_watchdog()
        deadline = time.monotonic() + FAILURE_REAP_S  # a worker killed mid-collective may take a moment
        while self.procs:
            for rank, proc in self._blame_order():
                proc.join(timeout=0)
                if not proc.is_alive():
                    died = self._died(rank)
                    self.close(graceful=False)
                    return died
            if isinstance(error, WorkerDied) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.close(graceful=False)
        return error

    def _stop_watchdog(self) -> None:
        self._stop_watch.set()
        if self._watchdog is not None:  # it may be in _kill_all, joining the workers
            self._watchdog.join(timeout=JOIN_TIMEOUT_S + 1)

    def check_alive(self) -> None:
        for rank, proc in self._blame_order():
            if not proc.is_alive():
                raise self._died(rank)

    def _blame_order(self) -> list:
        """(rank, process) of the workers, the one that exited first (if the watchdog saw it) first."""
        ranked = list(enumerate(self.procs, 1))
        return sorted(ranked, key=lambda rp: rp[0] != self._first_dead)

    def _died(self, rank: int) -> WorkerDied:
        proc, pipe = self.procs[rank - 1], self.pipes[rank - 1]
        proc.join(timeout=1.0)
        error = self._errors.get(rank)
        if error is None and pipe.poll():
            try:
                kind, value = pipe.recv()
                error = value if kind == "error" else None
            except (EOFError, OSError):
                pass
        code = proc.exitcode
        how = "is still running but stopped answering" if code is None else f"exited with code {code}"
        if code is not None and code < 0:
            how = f"was killed by signal {signal.Signals(-code).name}"
        place = ""
        if self.pipeline and self._tp_size > 1:  # which stage, which shard of it
            place = f" (stage {rank // self._tp_size}, tensor-parallel rank {rank % self._tp_size})"
        msg = f"{self.kind} worker rank {rank}{place} {how}; the engine cannot continue"
        return WorkerDied(msg + (f"\nits error: {error}" if error else ""))

    def _watch(self) -> None:
        """A worker that dies while the driver waits in a collective: stop the rest, so the
        collective errors out now instead of at the distributed timeout."""
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs, 1)}
        while not self._stop_watch.is_set():
            ready = wait(list(sentinels), timeout=0.5)
            if ready and self._first_dead is None:  # even when stopping: failure() asks who it was
                self._first_dead = min(sentinels[s] for s in ready)
            if ready and not self._stop_watch.is_set():
                ranks = sorted(sentinels[s] for s in ready)
                log.error("%s worker rank(s) %s exited; stopping the others", self.kind, ranks)
                self._kill_all()
                return

    # -- shutdown ------------------------------------------------------------------------------------

    def close(self, graceful: bool = True) -> None:
        """Stop the workers: a STOP record and a join (`graceful`), else (after a failure, when the
        ranks may be out of step) a kill at once."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if hasattr(self, "_stop_watch"):
            self._stop_watch.set()
        if graceful and hasattr(self, "channel") and all(p.is_alive() for p in self.procs):
            try:
                self._send_stop()
            except Exception as e:  # noqa: BLE001  (a worker gone mid-send: the kill below ends the rest)
                log.warning("could not send STOP to the workers: %s", e)
            for proc in self.procs:
                proc.join(timeout=JOIN_TIMEOUT_S)
        self._kill_all()
        distributed.leave()

    def _kill_all(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=JOIN_TIMEOUT_S)


def _with_rank(config: EngineConfig, rank: int) -> EngineConfig:
    import copy

    cfg = copy.deepcopy(config)
    cfg.parallel.rank = rank
    return cfg
