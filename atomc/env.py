"""The one place atomc reads environment variables, and which of them enter the compile cache key."""

from __future__ import annotations

import getpass
import os
from pathlib import Path

# Every variable atomc reads.
READ_VARS = (
    "ATOMC_CACHE_DIR",
    "ATOMC_CACHE_SIGNING_KEY_FILE",
    "XDG_CONFIG_HOME",
    "CVS_CONFIG_PROFILE",
    "CVS_INFERENCE_PREV_REPORT_JSON",
    "CVS_ATOM_PARITY_REF_JSON",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
)
# Read by `atomc bench` only: nothing the compiler builds depends on them. The last two are the
# run deck's comparison inputs (CVS's names): what a report is drawn against.
BENCH_VARS = ("CVS_CONFIG_PROFILE", "CVS_INFERENCE_PREV_REPORT_JSON", "CVS_ATOM_PARITY_REF_JSON")
# The ones that only say where things live: not a graph factor, so `--cache-dir X` and
# `ATOMC_CACHE_DIR=X` find the same entries, and a cache copied elsewhere still hits. Where the
# signing key lives is no graph factor either: one entry verifies under any path to the same key.
LOCATION_VARS = ("ATOMC_CACHE_DIR", "ATOMC_CACHE_SIGNING_KEY_FILE", "XDG_CONFIG_HOME")
# Set by torchrun for each rank it starts (a multi-node run): which rank a process is. Not a key
# factor as such: the rank enters the key as config.parallel.rank
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")

SIGNING_KEY_NAME = "cache-signing.key"


def cache_dir() -> Path:
    return Path(os.environ.get("ATOMC_CACHE_DIR", "~/.cache/atomc")).expanduser()


def config_dir() -> Path:
    """atomc's per-user config folder: $XDG_CONFIG_HOME/atomc, else ~/.config/atomc."""
    base = os.environ.get("XDG_CONFIG_HOME") or "~/.config"
    return Path(base).expanduser() / "atomc"


def signing_key_file() -> Path:
    """The compile cache's signing key: $ATOMC_CACHE_SIGNING_KEY_FILE, else the per-user one."""
    configured = os.environ.get("ATOMC_CACHE_SIGNING_KEY_FILE")
    return Path(configured).expanduser() if configured else config_dir() / SIGNING_KEY_NAME


def config_profile() -> str | None:
    """The CVS config profile `atomc bench sweep` runs when --config-profile is not given."""
    return os.environ.get("CVS_CONFIG_PROFILE") or None


def _optional_path(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value).expanduser() if value else None


def prev_report_json() -> Path | None:
    """$CVS_INFERENCE_PREV_REPORT_JSON: a previous run's report, for the deck's prev-run panels."""
    return _optional_path("CVS_INFERENCE_PREV_REPORT_JSON")


def parity_ref_json() -> Path | None:
    """$CVS_ATOM_PARITY_REF_JSON: another framework's report, for the deck's parity panel."""
    return _optional_path("CVS_ATOM_PARITY_REF_JSON")


def user_name() -> str:
    """The `{user-id}` of a CVS config: the local OS user (getpass reads LOGNAME/USER/... itself)."""
    return getpass.getuser()


def snapshot() -> dict[str, str | None]:
    """Values of every variable atomc reads."""
    return {name: os.environ.get(name) for name in READ_VARS}


def graph_snapshot() -> dict[str, str | None]:
    """Values of the variables that change what atomc builds (graphs/cache_key.py hashes these)."""
    skip = LOCATION_VARS + BENCH_VARS + LAUNCHER_VARS
    return {k: v for k, v in snapshot().items() if k not in skip}


def launched_rank(world_size: int) -> tuple[int, int, int] | None:
    """(rank, local rank, world size) when torchrun started this process, checked against the
    `world_size` (tensor-parallel size x pipeline stages) it was given; None when it did not start
    this process."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    launched = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), int(os.environ["WORLD_SIZE"])
    if launched[2] != world_size:
        raise ValueError(
            f"torchrun started {launched[2]} ranks, the engine has {world_size} "
            "(--tensor-parallel-size x --pipeline-parallel-size)"
        )
    return launched
