"""Errors users can hit: clear messages, never a silent truncation."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from atomc import LLM, SamplingParams
from atomc.cli.main import app


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_model_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(model=str(tmp_path / "nope"), device="cpu", enforce_eager=True)


def test_dir_without_config(tmp_path):
    with pytest.raises((FileNotFoundError, ValueError), match="config.json|no .gguf|checkpoint"):
        LLM(model=str(tmp_path), device="cpu", enforce_eager=True)


def test_missing_weights_and_pickle_only(llama_dir, tmp_path):
    d = copy_ckpt(llama_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        LLM(model=str(d), device="cpu", enforce_eager=True)
    (d / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="does not load pickled weights"):
        LLM(model=str(d), device="cpu", enforce_eager=True)


def test_missing_shard_named(llama_dir, tmp_path):
    d = copy_ckpt(llama_dir, tmp_path / "m")
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        LLM(model=str(d), device="cpu", enforce_eager=True)


def test_unsupported_architecture_names_supported_ones(llama_dir, tmp_path):
    d = copy_ckpt(llama_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(model=str(d), device="cpu", enforce_eager=True)


def test_prompt_longer_than_context_is_rejected(llama_dir):
    llm = LLM(model=str(llama_dir), device="cpu", enforce_eager=True, max_model_len=64)
    with pytest.raises(ValueError, match="context is 64"):
        llm.generate({"prompt_token_ids": [5] * 64}, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="exceeds the context"):
        llm.generate({"prompt_token_ids": [5] * 60}, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []})
    with pytest.raises(ValueError, match="token ids must be integers"):
        llm.generate({"prompt_token_ids": [10**6]})
    assert llm.engine.stats()["num_free_blocks"] == llm.engine.stats()["num_total_blocks"]


@pytest.mark.parametrize(
    "kw",
    [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(max_tokens=0), dict(n=0), dict(min_p=2)],
)
def test_bad_sampling_params(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_cli_generate_prints_text_and_fails_cleanly(llama_dir, tmp_path):
    runner = CliRunner()
    ok = runner.invoke(
        app,
        ["generate", "--model", str(llama_dir), "--prompt", "hello", "--max-tokens", "4", "--enforce-eager"],
    )
    assert ok.exit_code == 0, ok.output
    bad = runner.invoke(app, ["generate", "--model", str(tmp_path / "missing"), "--prompt", "x", "--enforce-eager"])
    assert bad.exit_code == 1 and "does not exist" in bad.output


def test_sharded_fp16_checkpoint_loads_and_matches(llama_dir, tmp_path):
    """A checkpoint saved in shards (index file) and in fp16 loads to the same logits (upcast to fp32)."""
    import torch
    import transformers

    from models.loader import load_model

    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float16)
    out = tmp_path / "sharded"
    hf.save_pretrained(out, max_shard_size="100KB")
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("*.safetensors"))) > 1
    ids = torch.arange(3, 40)
    a = load_model(out, torch.float32, "cpu")
    b = load_model(llama_dir, torch.float32, "cpu")
    with torch.no_grad():
        la, lb = (
            a.compute_logits(a(ids, torch.arange(ids.numel()))),
            b.compute_logits(b(ids, torch.arange(ids.numel()))),
        )
    assert (la - lb).abs().max().item() < 5e-2  # fp16 rounding of the stored weights only
    assert a.model.embed_tokens.weight.dtype == torch.float32


# ---------------------------------------------------------------- atomc serve: fail fast, before the model loads

import os  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _atomc(*args, timeout=60):
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "80"}
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "atomc.cli", *args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return p, time.monotonic() - t0


def test_serve_refuses_a_bad_port_before_loading_anything(tmp_path):
    missing = str(tmp_path / "no-model-here")  # would fail the load: the port must fail first
    p, _ = _atomc("serve", "--model", missing, "--port", "99999")
    assert p.returncode != 0 and "--port must be in [0, 65535]" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and "no-model-here" not in p.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p, seconds = _atomc("serve", "--model", missing, "--port", str(port))
    assert seconds < 30  # imports only: nothing loads before the port is bound
    assert p.returncode != 0 and f"cannot listen on 127.0.0.1:{port}" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and "no-model-here" not in p.stderr
    assert len([line for line in p.stderr.splitlines() if line.startswith("error:")]) == 1


def test_serve_refuses_an_empty_api_key(tmp_path):
    p, _ = _atomc("serve", "--model", str(tmp_path / "nope"), "--api-key", "", "--port", "0")
    assert p.returncode != 0 and "--api-key is empty" in p.stderr, p.stderr


def test_help_does_not_cut_flag_names_and_imports_no_torch():
    import typer.main

    from atomc.cli.main import app

    p, _ = _atomc("serve", "--help")
    assert p.returncode == 0
    command = typer.main.get_command(app).commands["serve"]
    names = [o for param in command.params for o in getattr(param, "opts", []) if o.startswith("--")]
    assert len(names) > 30
    for name in names:
        assert name in p.stdout, name  # rich's 80-column tables once printed `--max-num-batched-…`
    probe = "import sys, atomc.cli.main; print('torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr  # `atomc --help` must not pay torch's import
