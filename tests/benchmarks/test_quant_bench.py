"""The quantisation suite's own logic (benchmarks/quant_suite.sh, decode_bs1.py's engines and
rooflines, fp8_linear.py's plan and targets, quant_summary.py) on the CPU: what it can get wrong
before its one GPU call."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import checkpoints  # noqa: E402
import decode_bs1  # noqa: E402
import quant_summary  # noqa: E402

LLAMA = checkpoints.CONFIGS["llama-3.1-8b"]


def test_weight_bytes_per_format():
    # bf16: every parameter at 2 bytes (unchanged: the docs' 15.0 GB)
    assert checkpoints.weight_bytes("llama-3.1-8b") == 15_009_849_344
    layers, h, i = 32, 4096, 14336
    linear = h * 128 * (32 + 16) + 32 * 128 * h + 3 * h * i
    rows = 128 * 48 + h + 2 * i + h
    head = 128256 * h
    norms = (2 * layers + 1) * h * 2
    # atomc fp8: e4m3 linears, fp32 row scales, the LM head in bf16
    assert decode_bs1.roofline_bytes(LLAMA, "fp8") == layers * (linear + 4 * rows) + norms + 2 * head
    # gpt-fast int8: every nn.Linear in int8 (the LM head too), bf16 row scales
    assert decode_bs1.roofline_bytes(LLAMA, "int8") == layers * (linear + 2 * rows) + norms + head + 2 * 128256
    assert decode_bs1.roofline_bytes(LLAMA, "bf16") == checkpoints.weight_bytes(LLAMA)
    # the FP8 model reads a little over half the bytes: its roofline is ~1.87x bf16's
    ratio = decode_bs1.roofline_bytes(LLAMA, "bf16") / decode_bs1.roofline_bytes(LLAMA, "fp8")
    assert 1.85 < ratio < 1.9


def _args(**kw):
    base = dict(model="llama-3.1-8b", tiny=True, prompt_len=16, output_len=24, root="/tmp")
    return type("Args", (), {**base, **kw})()


def test_engines_map_to_their_commands():
    cmd = decode_bs1.child_command(_args(), "atomc-fp8")
    assert cmd[-5:] == ["--child", "atomc-fp8", "--tensor-parallel-size", "1", "--tiny"]
    assert decode_bs1.child_command(_args(tensor_parallel_size=2), "atomc")[-2:] == ["2", "--tiny"]
    with pytest.raises(SystemExit, match="runs on one GPU"):  # the peers have no TP
        decode_bs1.child_command(_args(tensor_parallel_size=2), "hf")
    assert decode_bs1.ENGINES["atomc-fp8"] == ("atomc", False, "fp8")
    peer = decode_bs1.child_command(_args(tiny=False), "gpt-fast-int8")
    assert peer[1].endswith("peers/gpt_fast_llama.py") and "--tiny" not in peer
    assert peer[peer.index("--quantize") + 1] == "int8" and peer[peer.index("--max-new-tokens") + 1] == "24"
    with pytest.raises(SystemExit, match="llama-3.1-8b only"):
        decode_bs1.child_command(_args(model="qwen3-8b"), "gpt-fast-int8")
    with pytest.raises(SystemExit, match="unknown engine"):
        decode_bs1.child_command(_args(), "atomc-int4")


def test_speedups_pair_each_quantised_engine_with_its_bf16_one():
    engines = [
        {"key": "atomc", "decode_tok_s": 200.0, "e2e_tok_s": 190.0},
        {"key": "atomc-fp8", "decode_tok_s": 350.0, "e2e_tok_s": 330.0},
        {"key": "gpt-fast-int8", "e2e_tok_s": 170.0},
        {"key": "atomc-no-pdl", "decode_tok_s": 160.0, "e2e_tok_s": 150.0},
        {"key": "atomc-fp8-no-pdl", "decode_tok_s": 280.0, "e2e_tok_s": 270.0},
        {"engine": "atomc-fp8-eager", "error": "boom"},  # no key: not paired
    ]
    assert decode_bs1.speedups(engines) == {
        "atomc-fp8 / atomc": 1.75, "gpt-fast-int8 / atomc": 0.85, "atomc / atomc-no-pdl": 1.25,
        "atomc-fp8 / atomc-fp8-no-pdl": 1.25,
    }  # fmt: skip


def test_run_child_kills_the_engine_when_the_script_is_terminated(tmp_path):
    # a timeout around decode_bs1.py (quant_suite.sh's box) must not leave its engine process running
    marker = tmp_path / "alive"
    engine = tmp_path / "engine.py"
    engine.write_text(f"import time, pathlib\ntime.sleep(3)\npathlib.Path({str(marker)!r}).write_text('x')\n")
    script = (
        f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import decode_bs1; "
        f"decode_bs1.run_child([sys.executable, {str(engine)!r}], 60, None)"
    )
    proc = subprocess.Popen([sys.executable, "-c", script])
    import time

    time.sleep(1.5)
    proc.terminate()
    assert proc.wait(10) == 128 + 15
    time.sleep(3)
    assert not marker.exists()


def test_missing_gpt_fast_is_reported_and_skipped(tmp_path):
    out = tmp_path / "decode.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "decode_bs1.py"), "--tiny", "--engines", "gpt-fast-int8",
           "--bandwidth", "1e10", "--root", str(tmp_path / "models"), "--out", str(out)]  # fmt: skip
    code = (
        f"import sys, runpy, pathlib; sys.argv = {cmd[1:]!r}; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
        f"import decode_bs1; decode_bs1.GPT_FAST_LLAMA = pathlib.Path({str(tmp_path / 'none')!r}); decode_bs1.main()"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "is missing" in proc.stderr
    (peer,) = json.loads(out.read_text())["engines"]
    assert peer["engine"] == "gpt-fast-int8" and "fetch_gpt_fast.sh" in peer["skipped"]


def test_fp8_linear_plan_puts_batch_one_and_the_block_target_first():
    import fp8_linear

    args = type("A", (), dict(shapes="qkv,down", tokens="1,64", dsv3_shapes="o", dsv3_tokens="2048"))()
    assert fp8_linear.plan(args) == [
        ("llama", "qkv", 1), ("llama", "down", 1), ("dsv3", "o", 2048), ("llama", "qkv", 64), ("llama", "down", 64),
    ]  # fmt: skip
    args.dsv3_shapes = "mla"
    with pytest.raises(SystemExit, match="unknown DeepSeek-V3 shape"):
        fp8_linear.plan(args)


def test_fp8_linear_targets():
    import fp8_linear

    rows = [
        dict(shape="qkv", m=1, impl="bf16", us=20.0),
        dict(shape="qkv", m=1, impl="gemv channel", us=12.5, pct_hbm=80.0),
        dict(shape="qkv", m=1, impl="gemv block", error="boom"),  # no time: left out
        dict(shape="dsv3 o", m=4096, impl="scaled_mm tensor", us=200.0, pct_fp8_peak=80.0),
        dict(shape="dsv3 o", m=4096, impl="triton block", us=250.0, pct_fp8_peak=64.0, tflops=1266.0,
             engine_route="scaled_mm_block"),
        dict(shape="dsv3 o", m=4096, impl="scaled_mm block", us=220.0, pct_fp8_peak=72.7, tflops=1439.0,
             engine_route="scaled_mm_block"),
        dict(shape="dsv3 o", m=512, impl="triton block", us=50.0, pct_fp8_peak=40.0, tflops=800.0),  # below M 2048
        # cuBLAS declined (skipped row): the engine runs the Triton GEMM
        dict(shape="dsv3 kv_b", m=2048, impl="scaled_mm tensor", us=100.0, pct_fp8_peak=60.0),
        dict(shape="dsv3 kv_b", m=2048, impl="triton block", us=125.0, pct_fp8_peak=48.0, tflops=950.0,
             engine_route="triton"),
        dict(shape="dsv3 kv_b", m=2048, impl="scaled_mm block", skipped="not sm_90"),
    ]  # fmt: skip
    t = fp8_linear.targets(rows)
    assert t["bs1_gemv"] == {"qkv gemv channel": {"speedup_vs_bf16": 1.6, "pct_hbm": 80.0}}
    assert t["dsv3_block_gemm"] == {
        "dsv3 o M=4096": dict(route="scaled_mm_block", pct_fp8_peak=72.7, tflops=1439.0, meets_70pct=True,
                              scaled_mm_tensor_pct_fp8_peak=80.0, time_vs_scaled_mm=1.1,
                              triton_pct_fp8_peak=64.0, triton_time_vs_scaled_mm=1.25,
                              cublas_pct_fp8_peak=72.7, cublas_time_vs_scaled_mm=1.1),
        "dsv3 kv_b M=2048": dict(route="triton", pct_fp8_peak=48.0, tflops=950.0, meets_70pct=False,
                                 scaled_mm_tensor_pct_fp8_peak=60.0, time_vs_scaled_mm=1.25,
                                 triton_pct_fp8_peak=48.0, triton_time_vs_scaled_mm=1.25),
    }  # fmt: skip


def test_summary_of_a_cut_short_run(tmp_path):
    assert "no junit XML" in quant_summary.summary(tmp_path)  # nothing there: lines, no exception
    (tmp_path / "gpu_tests.xml").write_text(
        '<testsuites><testsuite name="pytest" tests="4" failures="1" errors="0" skipped="1" time="12.5">'
        '<testcase classname="tests.kernels.test_triton_fp8_gpu" name="test_gemv[qkv]"/>'
        '<testcase classname="tests.kernels.test_triton_fp8_gpu" name="test_gemm[down]">'
        '<failure message="AssertionError: rel 0.3">trace</failure></testcase>'
        "</testsuite></testsuites>"
    )
    (tmp_path / "fp8_linear.json").write_text("{trunc")
    decode = {
        "engines": [
            {"engine": "atomc", "key": "atomc", "weights": "bf16", "decode_tok_s": 220.0, "e2e_tok_s": 210.0,
             "roofline_pct": 77.0, "roofline_tok_s": 284.0, "startup_s": 41.0},
            {"engine": "atomc-fp8", "weights": "fp8", "error": "Traceback\nRuntimeError: no kernel\n"},
        ],
        "speedups": {},
    }  # fmt: skip
    (tmp_path / "decode_bs1_llama31_8b.json").write_text(json.dumps(decode))
    moe = {
        "meta": {"weights": "mxfp4"},
        "rows": [
            {"tokens": 1, "impl": "atomc_triton", "us": 30.0},
            {"tokens": 1, "impl": "atomc_triton_mxfp4", "us": 12.0, "pct_peak_bw": 50.0, "rel_err": 3e-3,
             "ok": True, "route": "gemv"},
        ],
    }  # fmt: skip
    (tmp_path / "moe_kernel_mxfp4_gpt_oss.json").write_text(json.dumps(moe))
    text = quant_summary.summary(tmp_path).splitlines()
    assert text[0] == "- GPU tests: 2 passed, 1 failed, 0 errors, 1 skipped of 4 in 12 s"
    assert "FAILURE tests.kernels.test_triton_fp8_gpu::test_gemm[down]: AssertionError: rel 0.3" in text[1]
    assert "fp8_linear: fp8_linear.json: not there or not JSON" in text[2]
    assert text[3].startswith("- decode atomc: 220.0 tok/s decode, 77.0% of its bf16 roofline (284)")
    assert text[4] == "- decode atomc-fp8: ERROR RuntimeError: no kernel"
    assert "moe mxfp4 M=1: 12.0 us, 50.0% of HBM, 2.50x atomc bf16" in text[5]


def test_suite_script_parses_and_names_existing_tests():
    assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "quant_suite.sh")]).returncode == 0
    text = (ROOT / "benchmarks" / "quant_suite.sh").read_text()
    block = text[text.index("TESTS=(") : text.index(")", text.index("TESTS=("))]
    files = block.replace("TESTS=(", "").split()
    assert len(files) == 5 and all((ROOT / f).is_file() for f in files)
    assert subprocess.run(["bash", str(ROOT / "benchmarks" / "quant_suite.sh")], capture_output=True).returncode != 0


def test_summary_of_the_fp8_linear_targets(tmp_path):
    linear = {
        "rows": [{"shape": "qkv", "m": 8, "impl": "triton row", "us": 9.0, "rel_err": 0.3, "ok": False}],
        "targets": {
            "bs1_gemv": {"qkv gemv channel": {"speedup_vs_bf16": 1.6, "pct_hbm": 80.0}},
            "dsv3_block_gemm": {
                "dsv3 o M=4096": dict(route="scaled_mm_block", pct_fp8_peak=72.5, tflops=1435.0, meets_70pct=True,
                                      scaled_mm_tensor_pct_fp8_peak=80.0, time_vs_scaled_mm=1.1,
                                      triton_pct_fp8_peak=41.0, cublas_pct_fp8_peak=72.5),
                "dsv3 q_b M=2048": dict(route="scaled_mm_block", triton_pct_fp8_peak=30.0),  # cuBLAS row failed
                "dsv3 kv_b M=2048": dict(pct_fp8_peak=40.0, tflops=800.0, meets_70pct=False),  # an older JSON
            },
        },
    }  # fmt: skip
    (tmp_path / "fp8_linear.json").write_text(json.dumps(linear))
    lines = quant_summary.linear_section(tmp_path)
    assert lines == [
        "- fp8_linear: 1 rows, 1 failed",
        "  - qkv M=8 triton row: rel err 0.3",
        "  - M=1 qkv gemv channel: 1.60x bf16, 80.0% of HBM",
        "  - block GEMM dsv3 o M=4096 (scaled_mm_block): 72.5% of the FP8 peak (meets 70%), 1.10x the time of"
        " _scaled_mm tensorwise; Triton 41.0%, cuBLAS 72.5%",
        "  - block GEMM dsv3 q_b M=2048 (scaled_mm_block): no time for the engine's route; Triton 30.0%",
        "  - block GEMM dsv3 kv_b M=2048: 40.0% of the FP8 peak (below 70%)",
    ]


def test_fp8_linear_sweep_keeps_the_fastest_candidate_that_passes(monkeypatch):
    import fp8_linear
    import torch

    want = torch.ones(4)
    times = {None: 30.0, "slow": 40.0, "fast_wrong": 1.0, "raises": 0.5, "fast": 20.0}

    def fn_for(w, cfg):
        if cfg == "raises":
            raise RuntimeError("out of shared memory")
        return want * (2 if cfg == "fast_wrong" else 1)

    monkeypatch.setattr(fp8_linear, "per_call_us", lambda fn, weights: times[fn.__defaults__[0]])
    monkeypatch.setattr(fp8_linear, "SWEEP_DEADLINE", float("inf"))
    configs = [None, "slow", "fast_wrong", "raises", "fast"]
    us, cfg, check, default_us = fp8_linear.timed_best(fn_for, [None], want, configs)
    assert (us, cfg, check["ok"], default_us) == (20.0, "fast", True, 30.0)
    monkeypatch.setattr(fp8_linear, "SWEEP_DEADLINE", 0.0)  # budget spent: the default alone
    assert fp8_linear.timed_best(fn_for, [None], want, [None, "fast"])[:2] == (30.0, None)
    fp8_linear.FOUND.clear()
    fp8_linear.keep_best("gemv", 64, 128, 1, None, {"block_n": 16})
    fp8_linear.keep_best("gemv", 64, 128, 1, {"block_n": 32}, {"block_n": 16})  # a winner replaces it
    assert fp8_linear.FOUND == {"gemv": {(64, 128): {1: {"block_n": 32}}}}
    fp8_linear.FOUND.clear()


def test_fp8_linear_tiny_sweep_writes_a_tile_table(tmp_path):
    """The whole --sweep path on the CPU (Triton interpreter), budget 0: the defaults are timed and
    written as the winners into the table folder given, which the kernels' loader reads back."""
    out = tmp_path / "fp8.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fp8_linear.py"), "--tiny", "--sweep", "--sweep-budget-s", "0",
           "--shapes", "", "--out", str(out), "--configs-out", str(tmp_path / "tiles")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's atomc, whatever is installed
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (table,) = (tmp_path / "tiles").glob("*.json")
    raw = json.loads(table.read_text())
    assert table.name == "fp8_linear,device=cpu.json" and raw["meta"]["device"] == "cpu"
    # the tiny DeepSeek shape (kv_a: N 160, K 256) at M 33: the block GEMM's default tiles
    assert raw["kernels"]["block_gemm"]["160,256"]["33"]["block_k"] == 128
    rows = json.loads(out.read_text())["rows"]
    (gemm,) = [r for r in rows if r["impl"] == "triton block"]
    assert gemm["ok"] and gemm["config"] == raw["kernels"]["block_gemm"]["160,256"]["33"]


def test_run_child_takes_the_default_budget_and_kills_its_engine_on_an_error(tmp_path, monkeypatch):
    """decode_bs1's default --budget (1e9 s) once overflowed poll() and left the engine process
    running; now the wait is clamped, and any error in the wait kills the child's process group."""
    ok = [sys.executable, "-c", "print('RESULT {\"engine\": \"x\"}')"]
    result, _ = decode_bs1.run_child(ok, 1e9, None)
    assert result == {"engine": "x"}

    marker = tmp_path / "still_running"
    slow = [sys.executable, "-c", f"import time; time.sleep(3); open({str(marker)!r}, 'w').write('1')"]

    def fail(self, timeout=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(subprocess.Popen, "communicate", fail)
    with pytest.raises(KeyboardInterrupt):
        decode_bs1.run_child(slow, 60, None)
    monkeypatch.undo()
    time.sleep(4)
    assert not marker.exists(), "the child outlived run_child"
