"""The engine split over two ranks (this process the driver, one spawned worker, gloo on CPU) gives
the greedy tokens of one rank, eager and compiled, tensor- and expert-parallel; a worker that dies
ends the engine with a clear error in seconds, and no worker outlives its driver."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from atomc import LLM, SamplingParams
from atomc.runtime import distributed, step_codec
from atomc.runtime.batch import GroupTables, PromptLogprobRequest, StepInput
from tests.engine.helpers import assert_killed_worker_ends_the_engine

PROMPTS = ["The capital of France is", "def add(a, b):\n", "1 2 3"]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
SMALL = dict(device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=64, max_num_seqs=8)


def _tokens(path, **kw) -> list[list[int]]:
    with LLM(model=str(path), **SMALL, **kw) as llm:
        return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize(
    "family, kw",
    [
        pytest.param("llama", dict(enforce_eager=True), marks=pytest.mark.slow),  # CI time: the compiled one covers it
        ("llama", dict(enforce_eager=False)),  # each rank compiles its own artifact (collectives inside)
        ("qwen3_moe", dict(enforce_eager=True, enable_expert_parallel=True)),
    ],
    ids=["llama-eager", "llama-compiled", "qwen3_moe-ep-eager"],
)
def test_two_ranks_generate_the_tokens_of_one(checkpoints, tmp_path, family, kw):
    want = _tokens(checkpoints[family], enforce_eager=True)
    got = _tokens(checkpoints[family], tensor_parallel_size=2, cache_dir=str(tmp_path), **kw)
    assert got == want
    assert all(len(t) == 32 for t in got)


def test_a_killed_worker_ends_the_engine_with_a_clear_error(checkpoints):
    llm = LLM(model=str(checkpoints["llama"]), **SMALL, enforce_eager=True, tensor_parallel_size=2)
    assert_killed_worker_ends_the_engine(llm, llm.engine.executor.procs[0], "rank 1 was killed by signal SIGKILL")


_DRIVER = """
import sys, time
from atomc import LLM
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], device="cpu", dtype="float32", enforce_eager=True, max_model_len=128,
              num_kv_blocks=64, tensor_parallel_size=2)
    print(llm.engine.executor.procs[0].pid, flush=True)
    time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not reaped yet
    except FileNotFoundError:
        return True


def test_workers_exit_when_the_driver_dies(checkpoints, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    driver = subprocess.Popen([sys.executable, str(script), str(checkpoints["llama"])], stdout=subprocess.PIPE, env=env)
    try:
        worker = int(driver.stdout.readline())
        assert not _gone(worker)
        driver.kill()
        driver.wait()
        deadline = time.monotonic() + 10
        while not _gone(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(worker)
    finally:
        driver.kill()


@pytest.mark.slow  # three ranks on CI's two cores; the layers' error itself: tests/models/test_weight_loader.py
def test_heads_that_do_not_divide_fail_at_load(checkpoints):
    with pytest.raises(ValueError, match="attention heads = 4 does not divide across 3"):
        LLM(model=str(checkpoints["llama"]), **SMALL, enforce_eager=True, tensor_parallel_size=3)


def test_more_ranks_than_gpus_is_a_clear_error():
    import torch

    have = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"needs {have + 1} GPUs, this machine has {have}"):
        distributed.check_world("cuda", have + 1)


def test_the_step_record_round_trips_through_its_tensor():
    step = StepInput(
        7, [3, 9], [2, 1], [0, 5], [[4], [1, 2]], [11, -1, 12], [0, 1, 5], [64, 65, 37],
        [1, 2], [3, 9], [], feed_rows=[1], feed_sources=[0], feed_step=6,
        prompt_logprobs=[PromptLogprobRequest(3, 0, 2, [13])],
        group_tables=[GroupTables([[0], [8, 9]], [0, 1, 2])], masked_rows=[1],
    )  # fmt: skip
    back = step_codec.decode(step_codec.encode(step))
    for name in (
        "step_id", "seq_ids", "query_lens", "context_lens", "block_tables", "input_ids", "positions",
        "slot_mapping", "sample_rows", "sample_seq_ids", "feed_rows", "feed_sources", "feed_step",
        "prompt_logprobs", "group_tables", "masked_rows",
    ):  # fmt: skip
        assert getattr(back, name) == getattr(step, name), name
    empty = StepInput(0, [1], [1], [0], [[0]], [5], [0], [0], [], [], [])
    assert step_codec.decode(step_codec.encode(empty)).feed_step is None


def test_compile_builds_each_ranks_artifact_that_serve_then_loads(checkpoints, tmp_path):
    """`atomc compile -tp 2`: two processes build rank 0's and rank 1's entries (keyed by rank); an
    engine that may not compile (require_artifacts) then starts on them and decodes."""
    import json
    from pathlib import Path

    from typer.testing import CliRunner

    from atomc.cli.main import app
    from atomc.graphs.report import format_report

    args = ["compile", "--model", str(checkpoints["llama"]), "--device", "cpu", "--dtype", "float32",
            "--cache-dir", str(tmp_path), "--tensor-parallel-size", "2", "--max-num-seqs", "8", "--json"]  # fmt: skip
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    ranks = json.loads(out.output[out.output.index("{") :])["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and not any(r["hit"] for r in ranks)
    assert [r["factors"]["tp_rank"] for r in ranks] == [0, 1] and ranks[0]["entry"] != ranks[1]["entry"]
    for r in ranks:  # each rank's artifact fuses its 4 all-reduce + add + norm (2 layers), and says so
        (fusion,) = [p for p in r["passes"] if p["name"] == "fuse_allreduce_rmsnorm"]
        assert (fusion["matched"], fusion["rewritten"]) == (4, 4)
        lowered = (Path(r["entry"]) / r["passes"][-1]["graph"]).read_text()
        assert lowered.count("atomc.all_reduce_add_rms_norm.default(") == 4
        assert f"fuse_allreduce_rmsnorm    {4:>7}  {4:>9}" in format_report(r)  # the text report's line
    # (that the fused artifacts decode the tokens of one process: the llama-compiled case above)
    got = _tokens(checkpoints["llama"], tensor_parallel_size=2, cache_dir=str(tmp_path), require_artifacts=True)
    assert all(len(t) == 32 for t in got)


def test_compile_for_more_ranks_than_gpus_is_a_clear_error(checkpoints):
    import torch
    from typer.testing import CliRunner

    from atomc.cli.main import app

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine holds two ranks")
    out = CliRunner().invoke(app, ["compile", "--model", str(checkpoints["llama"]), "--device", "cuda", "-tp", "2"])
    assert out.exit_code == 1
    assert "needs 2 GPUs" in out.output or "sees no CUDA device" in out.output, out.output
