"""The engine process's decode-only tokenizer: the EOS id and the text of transformers' tokenizer,
without transformers, and the streaming detokenizer giving the same text through either."""

from __future__ import annotations

import json
import shutil

import pytest

from atomc.engine.detokenizer import DetokenizerState, decode_rest, decode_step
from atomc.engine.tokenizer import DecodingTokenizer, load_decoding_tokenizer, load_tokenizer


def test_eos_and_decode_match_transformers(llama_dir):
    full, light = load_tokenizer(llama_dir), load_decoding_tokenizer(llama_dir)
    assert isinstance(light, DecodingTokenizer)
    assert light.eos_token_id == full.eos_token_id is not None
    ids = full("Hello there, friend. It's 3.5 degrees!")["input_ids"] + [full.eos_token_id]
    for skip in (False, True):
        assert light.decode(ids, skip_special_tokens=skip) == full._tokenizer.decode(ids, skip_special_tokens=skip)


def test_streamed_text_is_the_same_through_either_tokenizer(llama_dir):
    full, light = load_tokenizer(llama_dir), load_decoding_tokenizer(llama_dir)
    prompt = full("def add(a, b):")["input_ids"]
    # ids that decode to partial characters mid-stream and at the end (byte tokens, if any)
    out = full(" return a + b  # \u00e9t\u00e9 \u2603")["input_ids"]
    texts = []
    for tok in (full, light):
        state, ids, text = DetokenizerState.start(tok, prompt, False), list(prompt), ""
        for t in out:
            ids.append(t)
            text += decode_step(tok, ids, state, False)
        texts.append(text + decode_rest(tok, ids, state, False))
    assert texts[0] == texts[1]
    assert texts[0].strip().startswith("return a + b")


def test_eos_from_an_added_token_dict_and_special_tokens_map(llama_dir, tmp_path):
    shutil.copy(llama_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    eos = load_tokenizer(llama_dir).eos_token
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": eos, "special": True}}))
    light = DecodingTokenizer(tmp_path)
    assert light.eos_token_id == light._tokenizer.token_to_id(eos)


def test_it_refuses_to_encode(llama_dir):
    light = load_decoding_tokenizer(llama_dir)
    with pytest.raises(RuntimeError, match="only decodes"):
        light("text")
    with pytest.raises(RuntimeError, match="only decodes"):
        light.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_folder_without_tokenizer_json_gets_transformers(llama_dir, tmp_path, monkeypatch):
    import atomc.engine.tokenizer as mod

    monkeypatch.setattr(mod, "load_tokenizer", lambda path: ("transformers", path))
    assert load_decoding_tokenizer(tmp_path) == ("transformers", tmp_path)
