"""Access-log noise control: uvicorn's access log without the lines of chosen paths.

Health probes and metric scrapers poll every few seconds, and their lines bury the requests one
reads a log for. `--disable-access-log-for-endpoints /health,/metrics` (vLLM's flag) drops the lines
of those paths (query strings ignored) and keeps the rest; `--disable-uvicorn-access-log` drops the
access log altogether. The filter rides in the logging config uvicorn installs itself (`log_config`),
so uvicorn's own set-up cannot replace it.
"""

from __future__ import annotations

import copy
import logging


def parse_endpoints(text: str | None) -> list[str]:
    """'/health, /metrics' -> ['/health', '/metrics']; empty items dropped. Each must be a path."""
    paths = [p.strip() for p in (text or "").split(",") if p.strip()]
    for p in paths:
        if not p.startswith("/"):
            raise ValueError(f"--disable-access-log-for-endpoints takes paths starting with '/', got {p!r}")
    return paths


class AccessLogFilter(logging.Filter):
    """Drops uvicorn.access records whose path (its third argument) is one of `excluded_paths`."""

    def __init__(self, excluded_paths: list[str] | tuple[str, ...] = ()):
        super().__init__()
        self.excluded = frozenset(excluded_paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) < 3 or not isinstance(args[2], str):
            return True
        return args[2].split("?", 1)[0] not in self.excluded


def uvicorn_log_config(excluded_paths: list[str]) -> dict | None:
    """uvicorn's default logging config with the filter on its access handler; None (uvicorn's
    default, untouched) when no path is excluded."""
    if not excluded_paths:
        return None
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config.setdefault("filters", {})["atomc_access_paths"] = {
        "()": AccessLogFilter,
        "excluded_paths": list(excluded_paths),
    }
    config["handlers"]["access"]["filters"] = ["atomc_access_paths"]
    return config
