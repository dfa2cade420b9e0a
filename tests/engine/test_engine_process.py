"""The engine in its own process: same outputs as the in-process engine, deltas that survive stop
strings / n > 1 / logprobs, clear start-up errors, and a dead engine process seen at once."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from atomc.config import EngineConfig
from atomc.engine.llm_engine import LLMEngine
from atomc.engine.process import EngineProcessClient, OutputDeltas, _Assembly
from atomc.outputs import CompletionOutput, RequestOutput
from atomc.sampling_params import SamplingParams
from atomc.serve.async_engine import AsyncEngine, EngineDeadError
from atomc.serve.server import uses_engine_process

REPO = Path(__file__).resolve().parents[2]


def make_config(model_dir) -> EngineConfig:
    cfg = EngineConfig(device="cpu")
    cfg.model.model = str(model_dir)
    cfg.model.max_model_len = 128
    cfg.compile.enforce_eager = True
    cfg.cache.num_kv_blocks = 64
    return cfg


def run_all(engine, requests) -> dict[str, RequestOutput]:
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    final: dict[str, RequestOutput] = {}
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def requests() -> list:
    return [
        ("greedy", "def add(a, b):", SamplingParams(temperature=0, max_tokens=12)),
        ("ids", [5, 9, 13, 17, 21], SamplingParams(temperature=0, max_tokens=9, logprobs=2, prompt_logprobs=1)),
        ("n2", "hello world", SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=10)),
        ("stop", "the quick brown fox", SamplingParams(temperature=0, max_tokens=20, stop=["ta"])),
    ]


def comparable(out: RequestOutput) -> tuple:
    seqs = [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in out.outputs]
    return out.prompt_token_ids, out.num_cached_tokens, seqs


def logprob_rows(out: RequestOutput) -> list:
    return [out.prompt_logprobs] + [c.logprobs for c in out.outputs]


def assert_same_logprobs(a: RequestOutput, b: RequestOutput) -> None:
    # close, not equal: the two processes may split CPU matmuls over different thread counts
    for x, y in zip(logprob_rows(a), logprob_rows(b), strict=True):
        assert (x is None) == (y is None)
        for dx, dy in zip(x or [], y or [], strict=True):
            assert (dx is None) == (dy is None)
            if dx is not None:
                assert dx.keys() == dy.keys()
                assert all(abs(dx[t] - dy[t]) < 1e-4 for t in dx)


def test_engine_process_matches_in_process_engine(llama_dir):
    local = run_all(LLMEngine(make_config(llama_dir)), requests())
    client = EngineProcessClient(make_config(llama_dir))
    try:
        remote = run_all(client, requests())
        assert client.stats()["num_free_blocks"] == client.stats()["num_total_blocks"]
    finally:
        client.close()
    assert not client.alive
    assert set(remote) == set(local)
    for rid in local:
        assert comparable(remote[rid]) == comparable(local[rid]), rid
        assert_same_logprobs(remote[rid], local[rid])
    assert remote["stop"].outputs[0].stop_reason == "ta"


def test_deltas_rebuild_cumulative_outputs():
    """Text that a stop string cuts back, n = 2, logprobs and prompt logprobs, across three steps."""

    def out(texts, tokens, finished=False, reasons=(None, None)):
        seqs = [
            CompletionOutput(i, t, list(tok), reasons[i], None, [{x: -0.5} for x in tok], -0.5 * len(tok))
            for i, (t, tok) in enumerate(zip(texts, tokens, strict=True))
        ]
        return RequestOutput("r", "p", [1, 2], seqs, finished, 3, [None, {2: -1.0}], {"arrival_time": 1.0})

    steps = [
        out(["he", "a"], [[4], [6]]),
        out(["hello wor", "ab"], [[4, 5], [6, 7]]),
        out(["hello", "abc"], [[4, 5, 8], [6, 7, 9]], True, ("stop", "length")),  # "wor" cut by a stop
    ]
    enc, asm = OutputDeltas(), _Assembly("r", "p", [1, 2], 2)
    for step in steps:
        rebuilt = asm.apply(enc.encode(step))
        assert comparable(rebuilt) == comparable(step)
        assert logprob_rows(rebuilt) == logprob_rows(step)
        assert rebuilt.finished == step.finished
    assert not enc.sent  # finished requests leave nothing behind on the engine side


def test_bad_model_dir_fails_at_start_up(tmp_path):
    cfg = make_config(tmp_path / "missing")
    t0 = time.monotonic()
    with pytest.raises((FileNotFoundError, ValueError, RuntimeError), match="missing"):
        EngineProcessClient(cfg)
    assert time.monotonic() - t0 < 60


def test_killed_engine_process_turns_health_off(llama_dir):
    client = EngineProcessClient(make_config(llama_dir))
    aengine = AsyncEngine(client)

    async def scenario():
        aengine.start()
        stream = await aengine.submit(
            [("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))]
        )
        os.kill(client._proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        assert not aengine.healthy
        with pytest.raises(EngineDeadError):
            await aengine.submit([("b", [5, 6], SamplingParams(max_tokens=2))])
        await aengine.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_serve_sigterm_to_the_group_drains_and_leaves_no_engine(llama_dir):
    """What `atomc bench` does to a server it started: SIGTERM to the whole process group."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "atomc.cli", "serve", "--model", str(llama_dir), "--device", "cpu",
           "--enforce-eager", "--max-model-len", "128", "--num-kv-blocks", "64", "--port", str(port),
           "--engine-process", "on"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        body = {"prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            os.killpg(proc.pid, signal.SIGTERM)  # mid-stream: the engine must keep going while the server drains
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # no process of the group is left (the engine process exits with the server)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    left = subprocess.run(["ps", "-o", "pid,args", "-g", str(proc.pid)], capture_output=True, text=True).stdout
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"processes left in the server's group:\n{left}")


def test_engine_process_setting():
    cfg = EngineConfig(device="cpu")
    assert not uses_engine_process(cfg)  # auto: a thread on the CPU
    cfg.serve.engine_process = "on"
    assert uses_engine_process(cfg)
    cfg.serve.engine_process = "sometimes"
    with pytest.raises(ValueError, match="auto, on or off"):
        uses_engine_process(cfg)


def test_auto_engine_process_asks_no_torch(monkeypatch):
    """auto + --device auto decides from the GPU device nodes, so the engine process is spawned
    before this process imports torch."""
    import atomc.platforms as platforms

    cfg = EngineConfig(device="auto")
    for present in (True, False):
        monkeypatch.setattr(platforms, "gpu_device_nodes_present", lambda present=present: present)
        assert uses_engine_process(cfg) is present
    cfg.device = "cuda:0"
    assert uses_engine_process(cfg)


def test_deciding_on_the_engine_process_imports_no_torch():
    code = (
        "import sys; from atomc.config import EngineConfig; from atomc.serve.server import uses_engine_process; "
        "uses_engine_process(EngineConfig()); assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_engine_stops_quietly_when_the_server_left_during_start_up(monkeypatch, tmp_path):
    """A server that stopped while the engine started (its own error already printed) leaves a
    closed pipe: the engine's "ready" must not end in a BrokenPipeError traceback, and the engine
    is still closed."""
    import multiprocessing
    from types import SimpleNamespace

    from atomc.engine import llm_engine, process

    closed = []

    class Engine:
        model_name, max_model_len, model_dir, sampling_defaults = "m", 8, tmp_path, {}
        arch = SimpleNamespace(vocab_size=10)

        def __init__(self, *args, **kwargs):
            pass

        def stats(self):
            return {}

        def close(self):
            closed.append(True)

    monkeypatch.setattr(llm_engine, "LLMEngine", Engine)
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # the test process keeps its handlers
    server_end, engine_end = multiprocessing.Pipe()
    server_end.close()
    process.run_engine_process(EngineConfig(device="cpu"), engine_end)
    assert closed == [True]
