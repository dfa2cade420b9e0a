"""The optional blocks' registry and the functional, platform and mtp_quality blocks, without a model."""

import json
import time
from pathlib import Path

import pytest

from atomc.bench.blocks import BlockResult, SuiteContext, functional, mtp_quality, platform, registry
from atomc.bench.suite import suite_exit_code
from atomc.bench.thresholds import GateRow, Status


def ctx(url="http://127.0.0.1:9", model="m") -> SuiteContext:
    return SuiteContext(url, model, Path("."), Path("."), log=lambda _: None)


# --- the registry --------------------------------------------------------------------------------


def test_configured_blocks_in_run_order():
    blocks = {
        "mtp_quality": {"enabled": True},
        "functional": {"api_smoke": True, "health_check": False},
        "platform": {"gpu_metrics_poll": {"interval_s": 0.5}, "dmesg_scan": True},
        "accuracy": {"tasks": []},
        "long_context_accuracy": {"enabled": False},
    }
    chosen = [(e.name, e.phase, spec) for e, spec in registry.configured_blocks(blocks)]
    assert chosen == [
        ("functional.api_smoke", "before", {}),
        ("platform.dmesg_scan", "during", {}),
        ("platform.gpu_metrics_poll", "during", {"interval_s": 0.5}),
        ("mtp_quality", "after", {"enabled": True}),
        ("accuracy", "after", {"tasks": []}),
    ]
    with pytest.raises(ValueError, match="unknown functional checks \\['api_smok'\\]; known: api_smoke, health_check"):
        registry.configured_blocks({"functional": {"api_smok": True}})
    with pytest.raises(ValueError, match="functional.api_smoke must be true, false or an object"):
        registry.configured_blocks({"functional": {"api_smoke": "yes"}})


def test_missing_block_module_is_an_error_not_a_crash(monkeypatch):
    entry = registry.BlockEntry("accuracy", "atomc.bench.blocks.no_such_module")
    result = registry.run_block(entry, {}, ctx())
    assert (result.block, result.verdict) == ("accuracy", "ERROR")
    assert result.reason.startswith("not available")
    no_fn = registry.BlockEntry("x", "atomc.bench.blocks.functional", "no_such_function")
    reason = registry.run_block(no_fn, {}, ctx()).reason
    assert reason == "not available: atomc.bench.blocks.functional has no no_such_function()"


def test_a_raising_block_becomes_its_error(monkeypatch):
    def boom(spec, c):
        raise RuntimeError("disk full")

    monkeypatch.setattr(functional, "run_api_smoke", boom)
    result = registry.run_block(registry.BY_NAME["functional.api_smoke"], {}, ctx())
    assert (result.verdict, result.reason) == ("ERROR", "RuntimeError: disk full")


def test_exit_code_counts_failed_and_errored_blocks():
    ok_row = GateRow("K", "failed", "max", "<= 0", 0, Status.PASS, "")
    for verdict, code in (("PASS", 0), ("SKIP", 0), ("FAIL", 1), ("ERROR", 1)):
        assert suite_exit_code([ok_row], [BlockResult("b", verdict)], enforce=True) == code
        assert suite_exit_code([ok_row], [BlockResult("b", verdict)], enforce=False) == 0


# --- functional ----------------------------------------------------------------------------------


def test_functional_fails_against_a_dead_server():
    result = functional.run_health_check({}, ctx())
    assert result.verdict == "FAIL" and result.reason == "failed: health, models"
    assert result.metrics == {"checks": 2.0, "failed_checks": 2.0}
    assert all(not r["ok"] and "ConnectError" in r["detail"] for r in result.rows)


# --- platform: dmesg -----------------------------------------------------------------------------

BOOT = ["[    0.000000] Linux version 6.1", "[    1.500000] amdgpu: loaded"]


def test_dmesg_scans_only_lines_logged_during_the_run():
    logs = [BOOT, BOOT + ["[   10.000000] eth0: link up", "[   12.000000] amdgpu: GPU reset begin!",
                          "[   13.000000] NVRM: Xid (PCI:0000:17:00): 79, GPU has fallen off the bus"]]  # fmt: skip
    scan = platform.DmesgScan(reader=lambda: logs.pop(0))
    result = scan.stop()
    assert result.verdict == "FAIL" and result.metrics == {"lines_scanned": 3.0, "error_lines": 2.0}
    assert [r["category"] for r in result.rows] == ["gpu_reset", "nvidia_xid"]
    clean = platform.DmesgScan(reader=lambda: BOOT)
    assert clean.stop().verdict == "PASS"


def test_dmesg_skips_when_the_log_is_not_readable():
    def denied():
        raise PermissionError("dmesg: read kernel buffer failed: Operation not permitted")

    result = platform.DmesgScan(reader=denied).stop()
    assert result.verdict == "SKIP" and "not readable: dmesg: read kernel buffer failed" in result.reason


def test_new_lines_without_timestamps_and_patterns():
    assert platform.new_lines(["a", "b"], ["a", "b", "c"]) == ["c"]
    assert platform.new_lines(["x", "b"], ["b", "c"]) == ["c"]  # the ring buffer dropped "x"
    hits = platform.scan_lines([
        "amdgpu 0000:03:00.0: [gfxhub] no-retry page fault (src_id:0 ring:24)",
        "Out of memory: Killed process 1234 (python)",
        "usb 1-1: new high-speed USB device",
    ])  # fmt: skip
    assert [h["category"] for h in hits] == ["fault", "oom"]


# --- platform: GPU metrics -----------------------------------------------------------------------


def test_gpu_poller_samples_on_a_thread():
    reads = iter(range(1000))

    def read():
        n = next(reads)
        return [{"gpu": 0, "power_w": 100.0 + n, "temperature_c": 50 + n, "memory_used_mb": 1e3, "sm_clock_mhz": 1980}]

    poller = platform.GpuPoller(read, "fake", interval_s=0.01)
    time.sleep(0.2)
    result = poller.stop()
    assert result.verdict == "PASS" and result.reason.endswith("from fake")
    n = len(result.samples)
    assert n >= 3 and [s["t"] for s in result.samples] == sorted(s["t"] for s in result.samples)
    assert result.metrics["peak_temperature_c"] == 50 + n - 1
    assert result.metrics["mean_power_w"] == pytest.approx(100 + (n - 1) / 2)
    assert not poller._thread.is_alive()


def test_gpu_poller_skips_without_a_source(monkeypatch):
    monkeypatch.setattr(platform, "nvml_sampler", lambda: None)
    monkeypatch.setattr(platform, "smi_sampler", lambda: None)
    result = platform.start_gpu_metrics_poll({}, ctx()).stop()
    assert result.verdict == "SKIP" and "neither NVML (nvidia-ml-py) nor amd-smi / rocm-smi" in result.reason


def test_gpu_poller_errors_when_every_read_fails():
    def read():
        raise OSError("smi crashed")

    poller = platform.GpuPoller(read, "amd-smi", interval_s=0.01)
    time.sleep(0.05)
    result = poller.stop()
    assert result.verdict == "ERROR" and result.rows[0] == {"error": "OSError: smi crashed"}


def test_parse_rocm_smi_and_amd_smi():
    rocm = {
        "card0": {
            "Temperature (Sensor junction) (C)": "45.0", "Average Graphics Package Power (W)": "350.0",
            "sclk clock speed:": "(2100Mhz)", "mclk clock speed:": "(1300Mhz)", "GPU use (%)": "97",
            "VRAM Total Memory (B)": str(192 * 2**30), "VRAM Total Used Memory (B)": str(150 * 2**30),
        },
        "system": {"Driver version": "6.8"},
    }  # fmt: skip
    (card,) = platform.parse_rocm_smi(json.dumps(rocm))
    assert card == {"gpu": 0, "temperature_c": 45.0, "power_w": 350.0, "sm_clock_mhz": 2100.0,
                    "mem_clock_mhz": 1300.0, "utilization_pct": 97.0, "memory_total_mb": 192 * 1024.0,
                    "memory_used_mb": 150 * 1024.0}  # fmt: skip
    amd = [{"gpu": 1, "power": {"socket_power": {"value": 700, "unit": "W"}},
            "clock": {"gfx_0": {"clk": {"value": 2000, "unit": "MHz"}}},
            "temperature": {"hotspot": {"value": 60, "unit": "C"}},
            "mem_usage": {"used_vram": {"value": 1000, "unit": "MB"}, "total_vram": {"value": 196592, "unit": "MB"}},
            "usage": {"gfx_activity": {"value": 88, "unit": "%"}}}]  # fmt: skip
    (gpu,) = platform.parse_amd_smi(json.dumps(amd))
    assert gpu == {"gpu": 1, "sm_clock_mhz": 2000.0, "power_w": 700.0, "temperature_c": 60.0,
                   "memory_used_mb": 1000.0, "memory_total_mb": 196592.0, "utilization_pct": 88.0}  # fmt: skip


@pytest.mark.gpu
def test_nvml_reads_the_gpus():
    read = platform.nvml_sampler()
    if read is None:
        pytest.skip("no NVML (nvidia-ml-py) or no NVIDIA GPU")
    readings = read()
    assert readings and all(r["memory_total_mb"] > 0 and r["sm_clock_mhz"] > 0 for r in readings)


# --- mtp_quality ---------------------------------------------------------------------------------

VLLM_SPEC_METRICS = """\
# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{model_name="m"} 100.0
# HELP vllm:spec_decode_num_draft_tokens Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{model_name="m"} 300.0
# HELP vllm:spec_decode_num_accepted_tokens Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 210.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 90.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 70.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 50.0
# HELP vllm:num_requests_running Running requests.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 0.0
"""


def test_acceptance_figures_from_vllm_named_counters():
    totals, per_pos = mtp_quality.spec_decode_counters(VLLM_SPEC_METRICS)
    assert totals == {"num_drafts": 100.0, "num_draft_tokens": 300.0, "num_accepted_tokens": 210.0}
    m = mtp_quality.acceptance_metrics(totals, per_pos)
    assert m["mtp.acceptance_rate"] == pytest.approx(0.7)
    assert m["mtp.mean_acceptance_length"] == pytest.approx(3.1)
    assert [m[f"mtp.acceptance_rate_pos{i}"] for i in range(3)] == pytest.approx([0.9, 0.7, 0.5])
    assert mtp_quality.spec_decode_counters("# nothing\natomc:num_requests_running 0\n") == ({}, {})


def test_degenerate_answers():
    assert mtp_quality.degenerate("") and mtp_quality.degenerate("ok")
    assert mtp_quality.degenerate("the the the the the the the the")
    assert not mtp_quality.degenerate("I am a small language model that answers questions.")


def test_suite_gates_only_blocks_that_do_not_gate_themselves():
    from atomc.bench.suite import block_gates

    thresholds = {
        "mtp_quality": {"mtp.acceptance_rate": {"kind": "min", "value": 0.5}},
        "accuracy": {"gsm8k_flex": {"gsm8k.exact_match__flexible-extract": {"kind": "min", "value": 0.9}}},
    }
    results = [BlockResult("mtp_quality", "PASS", metrics={"mtp.acceptance_rate": 0.4}),
               BlockResult("accuracy", "PASS", metrics={"gsm8k_flex/gsm8k.exact_match__flexible-extract": 0.1})]
    rows = block_gates(results, thresholds)
    assert [(r.cell, r.metric, r.status) for r in rows] == [("mtp_quality", "mtp.acceptance_rate", Status.FAIL)]


def test_mtp_quality_and_quant_parity_are_off_unless_enabled():
    assert registry.configured_blocks({"mtp_quality": {"chat_template_prompt": "x"}, "quant_parity": {}}) == []
    chosen = registry.configured_blocks({"mtp_quality": {"enabled": True}, "accuracy": {"tasks": [1]}})
    assert [e.name for e, _ in chosen] == ["mtp_quality", "accuracy"]


def any_model_app():
    """Completions for any model name (as SGLang serves them), streamed or not; no chat route."""
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if not body.get("stream"):
            choice = {"index": 0, "text": " Paris", "finish_reason": "length"}
            return {"choices": [choice], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}

        async def events():
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': ' Paris'}]})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_api_smoke_against_a_server_that_serves_any_model_name():
    """chat is missing (404): the block FAILs; the unknown-model check is advisory only."""
    import socket
    import threading

    import uvicorn

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(any_model_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        result = functional.run_api_smoke({"max_tokens": 2}, ctx(f"http://127.0.0.1:{port}", "any"))
    finally:
        srv.should_exit = True
        thread.join(timeout=5)
    rows = {r["check"]: r for r in result.rows}
    assert rows["completion"]["ok"] and rows["stream"]["ok"] and not rows["chat"]["ok"], rows
    assert not rows["unknown_model"]["ok"] and rows["unknown_model"]["advisory"]
    assert result.verdict == "FAIL" and result.reason == "failed: chat (advisory, not met: unknown_model)"
    assert result.metrics["failed_checks"] == 1.0
