"""The MoE benchmark scripts' own logic (benchmarks/decode_bs1_moe.py, moe_summary.py, checkpoints.py)
on the CPU: what they can get wrong before a GPU ever runs them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import checkpoints  # noqa: E402
import decode_bs1_moe  # noqa: E402
import moe_summary  # noqa: E402


def test_run_child_reads_the_result_line_and_kills_on_timeout(tmp_path):
    ok = [sys.executable, "-c", "print('noise'); print('RESULT {\"e2e_tok_s\": 5.0}')"]
    res, _ = decode_bs1_moe.run_child(ok, 60, tmp_path / "ok.log")
    assert res == {"e2e_tok_s": 5.0} and "noise" in (tmp_path / "ok.log").read_text()
    failed, tail = decode_bs1_moe.run_child([sys.executable, "-c", "raise SystemExit('broken')"], 60, None)
    assert failed is None and "broken" in tail
    slow = [sys.executable, "-c", "import time; print('RESULT {}'); time.sleep(60)"]
    res, tail = decode_bs1_moe.run_child(slow, 1, None)
    assert res is None and "killed after 1 s" in tail


def test_child_timeout_keeps_the_later_engines_reserve():
    # atomc first in a 570 s budget with one peer after it: 570 - 10 (the bandwidth measure) - 150
    assert decode_bs1_moe.child_timeout(570, 10, 150, 1) == 410
    # the peer gets whatever atomc left
    assert decode_bs1_moe.child_timeout(570, 130, 150, 0) == 440
    assert decode_bs1_moe.child_timeout(570, 569, 150, 0) == 30


def test_gpt_fast_is_the_mixtral_peer_only():
    args = type("Args", (), {"model": "qwen3-30b-a3b", "tiny": True, "output_len": 24, "root": "/tmp"})()
    with pytest.raises(SystemExit, match="mixtral-8x7b only"):
        decode_bs1_moe.child_command(args, "gpt-fast")
    args.model = "mixtral-8x7b"
    cmd = decode_bs1_moe.child_command(args, "gpt-fast")
    assert cmd[1].endswith("peers/gpt_fast_mixtral.py") and "--tiny" in cmd


def test_layers_cut_the_model_and_reach_the_child(tmp_path):
    import transformers

    # GPT-OSS: its per-layer window list is cut with the layers
    folder = checkpoints.make_checkpoint("gpt-oss-20b", tmp_path, layers=3)
    assert folder.name == "gpt-oss-20b-3l"
    cfg = transformers.AutoConfig.from_pretrained(folder)
    full = checkpoints.CONFIGS["gpt-oss-20b"]
    assert cfg.num_hidden_layers == 3 and list(cfg.layer_types) == full["layer_types"][:3]
    assert cfg.hidden_size == full["hidden_size"] and cfg.num_local_experts == full["num_local_experts"]
    assert checkpoints.CONFIGS["gpt-oss-20b"]["num_hidden_layers"] == 24  # the table is not touched
    with pytest.raises(ValueError, match="within 1..32"):
        checkpoints.model_config("mixtral-8x7b", layers=33)
    args = type("Args", (), {"model": "mixtral-8x7b", "tiny": False, "output_len": 24, "root": "/tmp", "layers": 20})()
    cmd = decode_bs1_moe.child_command(args, "atomc-fp8")
    assert cmd[cmd.index("--layers") + 1] == "20"
    with pytest.raises(SystemExit, match="whole model"):
        decode_bs1_moe.child_command(args, "gpt-fast")


@pytest.mark.parametrize("name", checkpoints.MOE_MODELS)
def test_tiny_checkpoint_is_a_config_transformers_reads(name, tmp_path):
    import transformers

    folder = checkpoints.make_checkpoint(name, tmp_path, tiny=True)
    assert folder.name == name + "-tiny"
    cfg = transformers.AutoConfig.from_pretrained(folder)
    assert cfg.architectures == checkpoints.CONFIGS[name]["architectures"] and cfg.num_hidden_layers == 2
    # a folder left by an older config is rewritten, not reused
    (folder / "config.json").write_text(json.dumps({"stale": True}))
    checkpoints.make_checkpoint(name, tmp_path, tiny=True)
    assert json.loads((folder / "config.json").read_text()) == checkpoints.tiny_config(name)


def test_unknown_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown benchmark model"):
        checkpoints.make_checkpoint("mixtral-8x22b", tmp_path)


def test_summary_rows(tmp_path):
    decode = {
        "model": "mixtral-8x7b", "roofline_tok_s": 165.6,
        "engines": [
            {"engine": "atomc", "decode_tok_s": 140.2, "e2e_tok_s": 138.0, "roofline_pct": 84.66, "startup_s": 61},
            {"engine": "gpt-fast", "error": "Traceback ...\nRuntimeError: CUDA out of memory"},
        ],
    }  # fmt: skip
    serving = {
        "model": "qwen3-30b-a3b", "isl": 1024, "osl": 1024,
        "atomc": [{"conc": 64, "output_throughput": 2600.0, "ceiling_tok_s": 3864.0, "ceiling_pct": 67.3,
                   "distinct_experts_per_layer": 125.94, "experts": 128, "median_tpot_ms": 22.1,
                   "median_ttft_ms": 1500.0, "completed": 64, "num_prompts": 64}],
        "hf": {"engine": "transformers generate_batch", "conc": 64, "output_len": 128, "output_tokens": 8192,
               "duration": 40.0, "output_throughput": 204.8},
    }  # fmt: skip
    (tmp_path / "decode_bs1_mixtral-8x7b.json").write_text(json.dumps(decode))
    (tmp_path / "serving_qwen3-30b-a3b").mkdir()
    (tmp_path / "serving_qwen3-30b-a3b" / "serving_qwen3-30b-a3b.json").write_text(json.dumps(serving))
    (tmp_path / "other.json").write_text("{}")  # not a result file: ignored
    table = moe_summary.summary(tmp_path).splitlines()
    assert len(table) == 2 + 4
    assert "| mixtral-8x7b | batch 1, decode | atomc | 140.2 | 84.7% of 166 |" in table[2]
    assert "ERROR: RuntimeError: CUDA out of memory" in table[3]
    assert "| 1024/1024 CONC 64 | atomc | 2,600 | 67% of 3,864 | D = 125.9 of 128 experts" in table[4]
    assert "completed 64/64" in table[4] and "204.8" in table[5]


def _supported(architecture: str) -> bool:
    from models.registry import SUPPORTED_ARCHITECTURES

    return architecture in SUPPORTED_ARCHITECTURES


@pytest.mark.slow
# Mixtral takes the same path as Qwen3; DeepSeek-V2-Lite its latent cache and MLA op
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-20b", "deepseek-v2-lite"])
def test_decode_tiny_end_to_end(name, tmp_path):
    # the script as the suite runs it, atomc's child process included, on the 2-layer toy model
    # (eager: the compile is what makes this slow on 2 cores, and the script's path is the same)
    arch = checkpoints.CONFIGS[name]["architectures"][0]
    if not _supported(arch):
        pytest.skip(f"{arch} is not an atomc family yet")
    out = tmp_path / "decode.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "decode_bs1_moe.py"), "--model", name, "--tiny",
           "--engines", "atomc-eager", "--root", str(tmp_path / "models"), "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    (atomc,) = res["engines"]
    assert atomc["engine"] == "atomc (eager)" and atomc["decode_tok_s"] > 0 and 0 < atomc["roofline_pct"] < 100


def _env() -> dict:
    import os

    # the children import this tree's atomc (not an installed copy)
    return {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}


def test_fp8_engines_run_atomc_with_online_fp8_against_the_fp8_roofline():
    import decode_bs1

    args = type("Args", (), {"model": "qwen3-30b-a3b", "tiny": True, "output_len": 24, "root": "/tmp"})()
    cmd = decode_bs1_moe.child_command(args, "atomc-fp8")
    assert cmd[cmd.index("--child") + 1] == "atomc-fp8" and "--tiny" in cmd
    with pytest.raises(SystemExit, match="unknown engine 'atomc-int4'"):
        decode_bs1_moe.child_command(args, "atomc-int4")
    assert decode_bs1_moe.ENGINES["atomc-fp8"] == ("atomc", False, "fp8")
    rooflines = {"bf16": 100.0, "fp8": 180.0}
    rows = [
        decode_bs1.engine_row("atomc", {"engine": "atomc", "decode_tok_s": 80.0, "e2e_tok_s": 70.0}, "", rooflines,
                              decode_bs1_moe.ENGINES),
        decode_bs1.engine_row("atomc-fp8", {"engine": "atomc fp8", "decode_tok_s": 144.0, "e2e_tok_s": 120.0}, "",
                              rooflines, decode_bs1_moe.ENGINES),
    ]  # fmt: skip
    assert [(r["weights"], r["roofline_pct"]) for r in rows] == [("bf16", 80.0), ("fp8", 80.0)]
    assert decode_bs1.speedups(rows) == {"atomc-fp8 / atomc": 1.8}


@pytest.mark.slow
def test_decode_tiny_fp8_end_to_end(tmp_path):
    # atomc bf16 and --quantization fp8 (FP8 experts) on the 2-layer toy Qwen3-MoE, eager, one call
    out = tmp_path / "decode.json"
    engines = "atomc-eager,atomc-fp8-eager"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "decode_bs1_moe.py"), "--model", "qwen3-30b-a3b", "--tiny",
           "--engines", engines, "--root", str(tmp_path / "models"), "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    bf16, fp8 = res["engines"]
    assert bf16["weights"] == "bf16" and fp8["weights"] == "fp8" and fp8["engine"] == "atomc fp8 (eager)"
    assert fp8["roofline_tok_s"] == res["rooflines_tok_s"]["fp8"] > res["rooflines_tok_s"]["bf16"]
    assert fp8["decode_tok_s"] > 0 and "atomc-fp8-eager / atomc-eager" in res["speedups"]


def test_an_mxfp4_checkpoint_holds_its_atomc_engines_to_the_mxfp4_roofline():
    table = decode_bs1_moe.engine_table(checkpoints.CONFIGS["gpt-oss-20b-mxfp4"])
    assert table["atomc"][2] == table["atomc-eager"][2] == "mxfp4"
    assert table["atomc-fp8"][2] == "fp8" and table["hf"][2] == "bf16"  # what --quantization or a peer runs
    assert decode_bs1_moe.engine_table(checkpoints.CONFIGS["gpt-oss-20b"]) is decode_bs1_moe.ENGINES
