"""The one place atomc reads environment variables. Every variable read here enters the compile cache key."""

from __future__ import annotations

import os
from pathlib import Path

# Variables that change what atomc builds or where; `graphs/cache_key.py` hashes their values.
READ_VARS = ("ATOMC_CACHE_DIR",)


def cache_dir() -> Path:
    return Path(os.environ.get("ATOMC_CACHE_DIR", "~/.cache/atomc")).expanduser()


def snapshot() -> dict[str, str | None]:
    """Values of every variable atomc reads (for the cache key and the manifest)."""
    return {name: os.environ.get(name) for name in READ_VARS}
