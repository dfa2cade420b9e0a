"""The one place atomc reads environment variables, and which of them enter the compile cache key."""

from __future__ import annotations

import os
from pathlib import Path

# Every variable atomc reads.
READ_VARS = ("ATOMC_CACHE_DIR",)
# The ones that only say where things live: not a graph factor, so `--cache-dir X` and
# `ATOMC_CACHE_DIR=X` find the same entries, and a cache copied elsewhere still hits.
LOCATION_VARS = ("ATOMC_CACHE_DIR",)


def cache_dir() -> Path:
    return Path(os.environ.get("ATOMC_CACHE_DIR", "~/.cache/atomc")).expanduser()


def snapshot() -> dict[str, str | None]:
    """Values of every variable atomc reads."""
    return {name: os.environ.get(name) for name in READ_VARS}


def graph_snapshot() -> dict[str, str | None]:
    """Values of the variables that change what atomc builds (graphs/cache_key.py hashes these)."""
    return {k: v for k, v in snapshot().items() if k not in LOCATION_VARS}
