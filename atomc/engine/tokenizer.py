"""Tokenizer and chat template, from the checkpoint directory (offline: never the hub)."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"{path} has no tokenizer.json or tokenizer_config.json")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
