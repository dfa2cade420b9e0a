"""`atomc compile --tensor-parallel-size N` (and/or `--pipeline-parallel-size P`): every rank's
artifact, built ahead of `atomc serve -tp N` (`-pp P`; both: N x P ranks, world rank = stage * N +
tensor-parallel rank, each (stage, tp rank) its own entry).

Each rank's graph holds its own shard's shapes and its collectives, and its cache key names its
rank and the world size (graphs/cache_key.py), so each rank builds its own entry; likewise each
pipeline stage, whose graph holds its own layers (and starts from hidden states after the first),
and under both each stage's shards, whose collectives run on the stage's own group. They are built
the way the engine builds them: N processes started with `spawn`, joined as one world
(atomc/runtime/distributed.py: NCCL on CUDA, gloo on CPU), each loading its shard and compiling,
so a trace that runs the model's collectives finds every rank in the same collective (a stage's
graph has none, but it is built as the engine's stage processes build it). Rank r's device is the
engine's (`cuda:r`), so the entries are the ones `serve -tp N` (`-pp P`) looks up.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait

from atomc.config import EngineConfig
from atomc.runtime import distributed

RANK_TIMEOUT_S = 3600.0  # a whole compile per rank: a cold 8B build is minutes; a hang still ends


class RankCompileError(RuntimeError):
    """A rank's compile failed or its process died."""


@dataclass
class RankResult:
    rank: int
    hit: bool
    entry_dir: str
    manifest: dict
    timings: dict


def compile_ranks(config: EngineConfig) -> list[RankResult]:
    """Compile (or find) the entry of each rank 0..N-1 of the world (tensor-parallel ranks,
    pipeline stages, or both: world rank = stage * T + tensor-parallel rank)."""
    from atomc.graphs.build import resolve_target

    par = config.parallel
    size = distributed.world_size(par)
    _, device, _ = resolve_target(config)
    distributed.check_world(device, size, distributed.world_flags(par))
    ctx = mp.get_context("spawn")
    init = distributed.local_init_method()
    procs, pipes = [], []
    for rank in range(size):
        cfg = copy.deepcopy(config)
        cfg.parallel.rank = rank
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_rank_main, args=(cfg, init, send), name=f"atomc-compile-rank-{rank}")
        proc.start()
        send.close()
        procs.append(proc)
        pipes.append(recv)
    try:
        return _collect(procs, pipes)
    finally:
        for proc in procs:  # a failed rank leaves the others waiting in a collective: end them
            if proc.is_alive():
                proc.kill()
            proc.join()


def _collect(procs, pipes) -> list[RankResult]:
    results: dict[int, RankResult] = {}
    pending = dict(enumerate(pipes))
    while pending:
        ready = wait([*pending.values(), *(procs[r].sentinel for r in pending)], timeout=RANK_TIMEOUT_S)
        if not ready:
            raise RankCompileError(f"rank {min(pending)} did not finish compiling in {RANK_TIMEOUT_S:.0f} s")
        for rank, pipe in list(pending.items()):
            if pipe in ready or procs[rank].sentinel in ready:
                try:
                    kind, payload = pipe.recv()
                except EOFError:
                    raise RankCompileError(
                        f"rank {rank}'s compile process exited (code {procs[rank].exitcode}) without a result"
                    ) from None
                if kind == "error":
                    raise RankCompileError(f"rank {rank}: {payload}")
                results[rank] = payload
                del pending[rank]
    return [results[r] for r in sorted(results)]


def _rank_main(config: EngineConfig, init: str, conn) -> None:
    """One rank's process: join, load the shard, compile, send the result (or the error)."""
    try:
        conn.send(("ok", _compile_rank(config, init)))
    except BaseException as e:  # noqa: BLE001  (reported to the parent, which exits non-zero)
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        sys.stderr.flush()
    finally:
        distributed.leave()


def _compile_rank(config: EngineConfig, init: str) -> RankResult:
    import torch

    from atomc.graphs.build import compile_or_load, resolve_target
    from models.loader import load_model

    par = config.parallel
    size = distributed.world_size(par)
    model_dir, device, dtype = resolve_target(config)
    device = distributed.rank_device(device, par.rank)
    if device == "cpu":  # the ranks share the cores
        torch.set_num_threads(max(1, torch.get_num_threads() // size))
    distributed.join(par.rank, size, device, init, par.distributed_timeout_s, par.tensor_parallel_size)
    model = load_model(model_dir, dtype, device, parallel=distributed.parallel_info(par),
                       quantization=config.model.quantization)  # fmt: skip
    res = compile_or_load(model, model_dir, config, device, dtype, progress=False)
    return RankResult(par.rank, res.hit, str(res.entry_dir), res.manifest, res.timings)
