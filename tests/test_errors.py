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
