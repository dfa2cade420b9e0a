"""Tokenizer and chat template, from the checkpoint directory (offline: never the hub).

Two loaders. `load_tokenizer`: transformers' tokenizer, for everything a front end does (encode,
chat templates, special tokens). `load_decoding_tokenizer`: what an engine process needs when the
server in front of it tokenizes (decoding ids and the EOS id), straight from `tokenizer.json`
through the `tokenizers` library. It skips transformers' import, which took 8.5-10.7 s of a warm
start on the H200 (the tokenizer file itself loads in 0.5 s), and decodes as the engine's
streaming detokenizer does (atomc/engine/detokenizer.py), so the text is the same either way.
"""

from __future__ import annotations

import json
from pathlib import Path


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{path} has no tokenizer.json or tokenizer_config.json")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def load_decoding_tokenizer(path: Path):
    """A DecodingTokenizer when the folder has a `tokenizer.json`, else transformers' tokenizer
    (a slow-only tokenizer has no file the `tokenizers` library reads)."""
    if not (path / "tokenizer.json").is_file():
        return load_tokenizer(path)
    return DecodingTokenizer(path)


class DecodingTokenizer:
    """Ids to text and the EOS id, from `tokenizer.json` (+ `tokenizer_config.json`); no encoding.

    `_tokenizer` is the `tokenizers.Tokenizer`, under the name transformers' fast tokenizers give it,
    because the detokenizer streams through it."""

    chat_template = None

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.eos_token_id = self._special_id(path, "eos_token")

    def _special_id(self, path: Path, name: str) -> int | None:
        """The id of a special token named in tokenizer_config.json (or special_tokens_map.json):
        a string or an added-token dict {"content": ...}."""
        for file in ("tokenizer_config.json", "special_tokens_map.json"):
            f = path / file
            if not f.is_file():
                continue
            token = json.loads(f.read_text()).get(name)
            if isinstance(token, dict):
                token = token.get("content")
            if isinstance(token, str):
                return self._tokenizer.token_to_id(token)
        return None

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __call__(self, *args, **kwargs):
        raise RuntimeError("this engine's tokenizer only decodes: its front end sends prompts as token ids")

    def apply_chat_template(self, *args, **kwargs):
        raise RuntimeError("this engine's tokenizer only decodes: its front end renders chat templates")
