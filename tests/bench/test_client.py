"""The bench client and sweep against a tiny fake OpenAI-compatible streaming server on loopback."""

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from typer.testing import CliRunner

from atomc.bench import sweep as sweep_mod
from atomc.bench.cli import bench_app
from atomc.bench.client import parse_sse_data
from atomc.bench.dataset import sample_random_requests
from atomc.bench.serve import BenchConfig, run_benchmark
from atomc.bench.sweep import launched_server, load_sweep_config
from atomc.bench.thresholds import GATED_METRICS

VOCAB = 500


def fake_openai_app() -> FastAPI:
    """Streams one text chunk per token; `app.state.fail_nth` makes that request answer 500."""
    app = FastAPI()
    app.state.count = 0
    app.state.fail_nth = 0
    app.state.send_usage = True
    app.state.payloads = []

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model", "vocab_size": VOCAB}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.count += 1
        app.state.payloads.append(body)
        if app.state.count == app.state.fail_nth:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)

        async def events():
            n = body["max_tokens"]
            for i in range(n):
                await asyncio.sleep(0.002)
                chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            if app.state.send_usage:
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fake_server():
    app = fake_openai_app()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "fake server did not start"
    yield app, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5)


@pytest.fixture
def server(fake_server):
    app, url = fake_server
    app.state.count, app.state.fail_nth, app.state.send_usage = 0, 0, True
    app.state.payloads.clear()
    return app, url


def bench(url: str, **kw) -> dict:
    cfg = dict(base_url=url, input_len=8, output_len=4, num_prompts=6, max_concurrency=2, show_progress=False)
    return run_benchmark(BenchConfig(**{**cfg, **kw}))


def test_counts_failures_and_tokens(server):
    app, url = server
    app.state.fail_nth = 2
    result = bench(url)
    assert (result["completed"], result["failed"]) == (5, 1)
    assert result["success_rate"] == pytest.approx(5 / 6)
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (40, 20)
    assert result["model"] == "fake-model" and result["vocab_size"] == VOCAB
    assert any("HTTP 500" in e for e in result["errors"])
    assert result["mean_ttft_ms"] > 0 and result["mean_itl_ms"] > 0 and result["mean_tpot_ms"] > 0
    assert result["mean_e2el_ms"] >= result["mean_ttft_ms"]
    assert result["request_rate"] == "inf" and result["max_concurrency"] == 2


def test_request_payload(server):
    app, url = server
    bench(url, num_prompts=2)
    body = app.state.payloads[0]
    assert body["model"] == "fake-model" and body["max_tokens"] == 4 and len(body["prompt"]) == 8
    assert all(0 <= t < VOCAB for t in body["prompt"])
    assert body["stream"] is True and body["ignore_eos"] is True and body["temperature"] == 0
    assert body["stream_options"] == {"include_usage": True}


def test_structured_json_schema_rides_on_every_request(server, tmp_path):
    app, url = server
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    out = CliRunner().invoke(bench_app, ["serve", "--base-url", url, "--input-len", "8", "--output-len", "3",
                                         "--num-prompts", "3", "--disable-tqdm", "--structured-json-schema",
                                         str(path), "--save-result", str(tmp_path / "r.json")])  # fmt: skip
    assert out.exit_code == 0, out.output
    assert len(app.state.payloads) == 3
    assert all(b["structured_outputs"] == {"json": schema} and b["max_tokens"] == 3 for b in app.state.payloads)
    assert json.loads((tmp_path / "r.json").read_text())["structured_outputs"] is True
    path.write_text("{nope")
    bad = CliRunner().invoke(bench_app, ["serve", "--base-url", url, "--structured-json-schema", str(path)])
    assert bad.exit_code != 0 and "not JSON" in bad.output


def test_warmups_go_first_with_other_prompts_and_are_not_counted(server):
    app, url = server
    app.state.fail_nth = 1  # a failed warm-up is reported, not counted among the measured requests
    result = bench(url, num_prompts=3, output_len=20, num_warmups=2)
    bodies = app.state.payloads
    assert len(bodies) == 5
    warm, measured = bodies[:2], bodies[2:]  # the warm-ups finish before the measured run starts
    assert all(b["max_tokens"] == 16 for b in warm) and all(b["max_tokens"] == 20 for b in measured)
    assert not {tuple(b["prompt"]) for b in warm} & {tuple(b["prompt"]) for b in measured}
    assert (result["completed"], result["failed"], result["num_prompts"]) == (3, 0, 3)
    assert (result["num_warmups"], result["warmup_failed"]) == (2, 1)
    assert result["total_output_tokens"] == 60
    # without warm-ups the measured prompts are the same ones (the seed decides them)
    app.state.payloads.clear()
    bench(url, num_prompts=3, output_len=20)
    assert sorted(b["prompt"] for b in app.state.payloads) == sorted(b["prompt"] for b in measured)


def test_counts_chunks_without_usage(server):
    app, url = server
    app.state.send_usage = False
    result = bench(url, num_prompts=3, output_len=5)
    assert result["completed"] == 3 and result["total_output_tokens"] == 15


def test_poisson_arrivals(server):
    _, url = server
    result = bench(url, num_prompts=4, max_concurrency=None, request_rate=200.0)
    assert result["completed"] == 4 and result["request_rate"] == 200.0


def test_unreachable_server_counts_as_failed():
    port = free_port()  # nothing listens there
    result = bench(f"http://127.0.0.1:{port}", model="m", vocab_size=100, num_prompts=2)
    assert (result["completed"], result["failed"]) == (0, 2)


def test_parse_sse_data():
    assert parse_sse_data('data: {"a": 1}') == '{"a": 1}'
    assert parse_sse_data("data: [DONE]") == "[DONE]"
    assert parse_sse_data("") is None and parse_sse_data(": keep-alive") is None
    assert parse_sse_data("event: message") is None


def test_random_dataset_lengths_and_ids():
    a = sample_random_requests(50, 100, 20, range_ratio=0.5, vocab_size=64, seed=3)
    b = sample_random_requests(50, 100, 20, range_ratio=0.5, vocab_size=64, seed=3)
    assert a == b
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.output_len <= 30 for r in a)
    assert all(0 <= t < 64 for r in a for t in r.prompt_ids)
    fixed = sample_random_requests(4, 32, 16, seed=0)
    assert {(r.prompt_len, r.output_len) for r in fixed} == {(32, 16)}


def write_sweep(tmp_path, strict: bool):
    config = {
        "schema_version": 1,
        "framework": "atomc",
        "enforce_thresholds": True,
        "threshold_json": "thr.json",
        "model": {"id": None},
        "params": {"num_prompts": 3, "tensor_parallelism": 1, "pipeline_parallel_size": 1},
        "sweep": {
            "sequence_combinations": [{"name": "s", "isl": 8, "osl": 4}],
            "runs": [{"combo": "s", "concurrency": 1}, {"combo": "s", "concurrency": 2}],
        },
    }
    bound = 1e9 if strict else 1  # no server reaches a billion tok/s
    gated = {
        "success_rate": {"kind": "min", "value": 1},
        "output_throughput": {"kind": "min_tok_s", "value": bound},
        "mean_tpot_ms": {"kind": "info"},
    }
    # enforce_thresholds: every gated metric needs a spec in a gated cell; info records the rest
    thresholds = {"ISL=8,OSL=4,TP=1,PP=1,CONC=1": {m: gated.get(m, {"kind": "info"}) for m in GATED_METRICS}}
    (tmp_path / "sweep.json").write_text(json.dumps(config))
    (tmp_path / "thr.json").write_text(json.dumps(thresholds))
    return tmp_path / "sweep.json"


def run_sweep_cli(*args):
    return CliRunner().invoke(bench_app, ["sweep", "--disable-tqdm", *args])


def test_sweep_passes_and_writes_results(server, tmp_path):
    _, url = server
    config = write_sweep(tmp_path, strict=False)
    out = tmp_path / "out"
    result = run_sweep_cli("--config", str(config), "--base-url", url, "--output-dir", str(out))
    assert result.exit_code == 0, result.output
    assert "no thresholds for cell" in result.output  # the CONC=2 cell
    saved = json.loads((out / "report.json").read_text())
    assert set(saved["cells"]) == {"ISL=8,OSL=4,TP=1,PP=1,CONC=1", "ISL=8,OSL=4,TP=1,PP=1,CONC=2"}
    assert saved["cells"]["ISL=8,OSL=4,TP=1,PP=1,CONC=2"]["completed"] == 3
    assert {g["status"] for g in saved["gates"]} == {"PASS", "INFO", "SKIP"}
    assert saved["schema"] == "atomc.bench.report/1" and saved["exit_code"] == 0 and saved["finished_at"]
    assert saved["server_started"] is False and saved["blocks"] == []
    cell = saved["cells"]["ISL=8,OSL=4,TP=1,PP=1,CONC=1"]
    assert cell["per_gpu_throughput"] == pytest.approx(cell["total_token_throughput"])  # TP=1, PP=1
    assert (out / "cells" / "results_ISL8_OSL4_TP1_PP1_CONC1.json").is_file()  # params.result_filename


def test_sweep_fails_when_enforced_and_records_otherwise(server, tmp_path):
    _, url = server
    config = write_sweep(tmp_path, strict=True)
    args = ["--config", str(config), "--base-url", url, "--output-dir", str(tmp_path)]
    enforced = run_sweep_cli(*args)
    assert enforced.exit_code == 1, enforced.output
    assert "FAIL" in enforced.output
    recorded = run_sweep_cli(*args, "--no-enforce")
    assert recorded.exit_code == 0, recorded.output
    assert "record-only" in recorded.output


HEALTH_SERVER = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_launched_server_is_stopped_even_on_error(tmp_path, monkeypatch):
    spawned = []
    real_popen = subprocess.Popen

    def recording_popen(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        spawned.append(proc)
        return proc

    monkeypatch.setattr(
        sweep_mod, "server_command", lambda model, port, extra: [sys.executable, "-c", HEALTH_SERVER, str(port)]
    )
    monkeypatch.setattr(sweep_mod.subprocess, "Popen", recording_popen)
    config = write_sweep(tmp_path, strict=False)
    cfg = load_sweep_config(config)
    with pytest.raises(RuntimeError, match="cell crashed"):
        with launched_server(cfg, tmp_path / "server.log", log=lambda _: None) as url:
            assert url.startswith("http://127.0.0.1:")
            assert spawned[0].poll() is None  # up and answering /health
            raise RuntimeError("cell crashed")
    assert spawned and spawned[0].poll() is not None


def test_multinode_run_against_a_user_started_server_gates_scaling(server, tmp_path):
    """vllm_atom PP=2 over 2 nodes: the user starts the servers; the suite computes and gates
    scaling.efficiency_pct against nnodes x the single-node baseline."""
    _, url = server
    config = {
        "schema_version": 1,
        "enforce_thresholds": True,
        "threshold_json": "mn_threshold.json",
        "model": {"id": None},
        "params": {
            "driver": "vllm_atom", "nnodes": "2", "pipeline_parallel_size": "2", "tensor_parallelism": "8",
            "master_addr": "10.0.0.1", "num_prompts": "3", "scaling_baseline_output_throughput": "1e9",
        },
        "sweep": {"sequence_combinations": [{"name": "s", "isl": 8, "osl": 4}],
                  "runs": [{"combo": "s", "concurrency": 2}]},
    }  # fmt: skip
    key = "ISL=8,OSL=4,TP=8,PP=2,CONC=2"
    specs = {m: {"kind": "info"} for m in GATED_METRICS} | {"scaling.efficiency_pct": {"kind": "min", "value": 80}}
    (tmp_path / "mn.json").write_text(json.dumps(config))
    (tmp_path / "mn_threshold.json").write_text(json.dumps({key: specs}))
    no_url = run_sweep_cli("--config", str(tmp_path / "mn.json"), "--output-dir", str(tmp_path))
    assert no_url.exit_code == 2 and "atomc does not start vllm_atom servers" in no_url.output
    result = run_sweep_cli("--config", str(tmp_path / "mn.json"), "--base-url", url, "--output-dir", str(tmp_path))
    assert result.exit_code == 1, result.output  # a fake server is far below 80% of 2 x 1e9 tok/s
    report = json.loads((tmp_path / "report.json").read_text())
    gate = next(g for g in report["gates"] if g["metric"] == "scaling.efficiency_pct")
    assert gate["status"] == "FAIL" and gate["actual"] == pytest.approx(
        100 * report["cells"][key]["output_throughput"] / 2e9
    )
    assert report["topology"]["nnodes"] == 2 and "multi-node run (nnodes=2)" in " ".join(report["notes"])


def test_client_budget_cuts_a_cell_off(server, tmp_path):
    """params.client_*: a cell whose client runs past initial wait + polls x wait counts as all failed."""
    _, url = server
    config = {
        "schema_version": 1,
        "model": {"id": None},
        "params": {"num_prompts": "4", "client_initial_wait_s": "0", "client_poll_count": "1",
                   "client_poll_wait_time": "0.05", "bench_max_failed_requests": "0"},
        "sweep": {"sequence_combinations": [{"name": "s", "isl": 8, "osl": 200}],
                  "runs": [{"combo": "s", "concurrency": 1}]},
    }  # fmt: skip
    (tmp_path / "slow.json").write_text(json.dumps(config))
    result = run_sweep_cli("--config", str(tmp_path / "slow.json"), "--base-url", url, "--output-dir", str(tmp_path))
    report = json.loads((tmp_path / "report.json").read_text())
    cell = report["cells"]["ISL=8,OSL=200,TP=1,PP=1,CONC=1"]
    assert (cell["completed"], cell["failed"], cell["success_rate"]) == (0, 4, 0.0)
    assert "client did not finish within 0.05s" in cell["errors"][0]
    failed_gate = next(g for g in report["gates"] if g["reason"].endswith("params.bench_max_failed_requests 0"))
    assert failed_gate["status"] == "FAIL"
    assert result.exit_code == 0  # record-only


@pytest.mark.parametrize("reuse, starts", [(None, 1), ("true", 2), ("false", 3)])
def test_reuse_server_across_sweep_restarts_the_server(server, tmp_path, monkeypatch, reuse, starts):
    """Unset: one server for the sweep; true: one per shape (CVS's session key); false: one per cell.
    Functional blocks run once, on the first server."""
    import contextlib

    from atomc.bench import suite

    _, url = server
    started = []

    @contextlib.contextmanager
    def fake_launch(cfg, log_path, log=print):
        started.append(cfg)
        yield url

    monkeypatch.setattr(suite.sw, "launched_server", fake_launch)
    params = {"num_prompts": "1"} | ({} if reuse is None else {"reuse_server_across_sweep": reuse})
    config = {
        "schema_version": 1,
        "model": {"id": None},
        "params": params,
        "functional": {"health_check": True},
        "sweep": {
            "sequence_combinations": [{"name": "a", "isl": 8, "osl": 2}, {"name": "b", "isl": 4, "osl": 2}],
            "runs": [{"combo": c, "concurrency": n} for c, n in (("a", 1), ("a", 2), ("b", 1))],
        },
    }
    (tmp_path / "r.json").write_text(json.dumps(config))
    result = run_sweep_cli("--config", str(tmp_path / "r.json"), "--output-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert len(started) == starts
    report = json.loads((tmp_path / "report.json").read_text())
    assert [b["block"] for b in report["blocks"]] == ["functional.health_check"]
    assert len(report["cells"]) == 3


def test_a_server_that_never_answers_ends_the_run_with_a_message(tmp_path):
    config = {
        "schema_version": 1,
        "model": {"id": None},
        "params": {"num_prompts": "1", "server_ready_timeout_s": "1"},
        "sweep": {"sequence_combinations": [{"name": "s", "isl": 8, "osl": 2}],
                  "runs": [{"combo": "s", "concurrency": 1}]},
    }
    (tmp_path / "c.json").write_text(json.dumps(config))
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = run_sweep_cli("--config", str(tmp_path / "c.json"), "--base-url", url, "--output-dir", str(tmp_path))
    assert result.exit_code == 1
    assert f"error: the server at {url} did not answer GET /v1/models within 1s" in result.output


def test_a_configured_block_without_its_module_is_reported_and_fails_an_enforced_run(server, tmp_path, monkeypatch):
    from dataclasses import replace

    from atomc.bench.blocks import registry

    _, url = server
    missing = tuple(replace(e, module="atomc.bench.blocks.not_built") if e.name == "accuracy" else e
                    for e in registry.REGISTRY)  # fmt: skip
    monkeypatch.setattr(registry, "REGISTRY", missing)
    config = {
        "schema_version": 1,
        "enforce_thresholds": True,
        "model": {"id": None},
        "params": {"num_prompts": "1"},
        "accuracy": {"tasks": [{"id": "gsm8k_flex", "task": "gsm8k"}]},
        "sweep": {"sequence_combinations": [{"name": "s", "isl": 8, "osl": 2}],
                  "runs": [{"combo": "s", "concurrency": 1}]},
    }  # fmt: skip
    (tmp_path / "c.json").write_text(json.dumps(config))
    result = run_sweep_cli("--config", str(tmp_path / "c.json"), "--base-url", url, "--output-dir", str(tmp_path))
    assert result.exit_code == 1, result.output
    report = json.loads((tmp_path / "report.json").read_text())
    (block,) = report["blocks"]
    assert block["block"] == "accuracy" and block["verdict"] == "ERROR" and block["reason"].startswith("not available")
    assert report["summary"]["blocks_failed"] == 1
