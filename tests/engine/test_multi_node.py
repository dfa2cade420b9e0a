"""`--nnodes 2`: the command run once per node execs torchrun, which starts that node's ranks; node 0's
rank 0 is the engine and prints the text, node 1's ranks are workers and print nothing. Two "nodes"
on this machine (gloo over localhost) give the tokens of one process, with tensor parallelism over
both and with a pipeline stage a node (two tensor-parallel ranks each)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from atomc.cli.launch import torchrun_argv
from atomc.config import EngineConfig

PROMPT = "Once upon a time"


def _cli(model_dir, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "atomc.cli", "generate", "--prompt", PROMPT, "--model", str(model_dir),
        "--device", "cpu", "--dtype", "float32", "--enforce-eager", "--max-tokens", "12", *extra,
    ]  # fmt: skip


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # three CLI processes (~50 s): CI's budget; `pytest -m slow` runs it
@pytest.mark.parametrize(
    "split",
    [["-tp", "2"], ["-tp", "2", "-pp", "2"]],
    ids=["tp2", "tp2-pp2"],  # the second: each node one stage of two tensor-parallel ranks
)
def test_two_nodes_generate_the_text_of_one_process(llama_dir, split):
    one = subprocess.run(_cli(llama_dir), env=_env(), capture_output=True, text=True, timeout=300, check=True)
    port = str(_free_port())
    nodes = [
        subprocess.Popen(
            _cli(llama_dir, *split, "--nnodes", "2", "--node-rank", str(r), "--master-port", port),
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=300) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [err[-2000:] for _, err in outs]
    assert one.stdout.strip() and outs[0][0] == one.stdout  # node 0 prints the engine's text
    assert outs[1][0] == ""  # node 1's rank is a worker


def test_torchrun_command_and_its_errors():
    cfg = EngineConfig().update(tensor_parallel_size=8, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=7)
    argv = torchrun_argv(cfg, ["serve", "--model", "m"])
    assert argv[1:3] == ["-m", "torch.distributed.run"] and argv[-5:] == ["-m", "atomc.cli", "serve", "--model", "m"]
    assert {"--nnodes=2", "--node-rank=1", "--nproc-per-node=4", "--master-addr=10.0.0.1", "--master-port=7"} <= set(
        argv
    )
    with pytest.raises(ValueError, match="does not divide across --nnodes 3"):
        torchrun_argv(EngineConfig().update(tensor_parallel_size=8, nnodes=3), [])
    with pytest.raises(ValueError, match="--node-rank 2 is not a node of --nnodes 2"):
        torchrun_argv(EngineConfig().update(tensor_parallel_size=2, nnodes=2, node_rank=2), [])
    # stages across nodes: tp x pp / nnodes ranks a node (world rank = stage * tp + tp rank, so with
    # as many nodes as stages each node holds one stage)
    argv = torchrun_argv(EngineConfig().update(tensor_parallel_size=4, pipeline_parallel_size=2, nnodes=2), [])
    assert "--nproc-per-node=4" in argv
    with pytest.raises(ValueError, match=r"--pipeline-parallel-size 3 = 6 ranks does not divide across --nnodes 4"):
        torchrun_argv(EngineConfig().update(tensor_parallel_size=2, pipeline_parallel_size=3, nnodes=4), [])


def test_a_torchrun_world_of_another_size_is_refused(monkeypatch):
    from atomc import env

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert env.launched_rank(2) == (0, 0, 2)
    with pytest.raises(ValueError, match=r"torchrun started 2 ranks, the engine has 4"):
        env.launched_rank(4)
