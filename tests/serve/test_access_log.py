"""--disable-uvicorn-access-log and --disable-access-log-for-endpoints: the filter, the flag's
parsing, and how they land in uvicorn's config (no server needed)."""

from __future__ import annotations

import logging

import pytest

from atomc.config import EngineConfig
from atomc.serve.access_log import AccessLogFilter, parse_endpoints, uvicorn_log_config
from atomc.serve.server import uvicorn_config


def record(path: str) -> logging.LogRecord:
    # uvicorn's access record: (client, method, path with query, http version, status)
    args = ("127.0.0.1:5000", "GET", path, "1.1", 200)
    return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d', args, None)


def test_filter_drops_only_the_excluded_paths():
    f = AccessLogFilter(["/health", "/metrics"])
    assert not f.filter(record("/health"))
    assert not f.filter(record("/metrics?x=1"))  # the query string does not matter
    assert f.filter(record("/v1/completions"))
    assert f.filter(record("/healthz"))
    other = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, "no args", None, None)
    assert f.filter(other)


def test_parse_endpoints():
    assert parse_endpoints(" /health, /metrics ,,") == ["/health", "/metrics"]
    assert parse_endpoints(None) == [] == parse_endpoints("")
    with pytest.raises(ValueError, match="starting with '/'"):
        parse_endpoints("health")


def test_flags_map_onto_uvicorn_config():
    cfg = EngineConfig()
    plain = uvicorn_config(object(), cfg)
    assert plain.access_log and uvicorn_log_config([]) is None
    cfg.serve.disable_uvicorn_access_log = True
    assert not uvicorn_config(object(), cfg).access_log
    cfg = EngineConfig().update(disable_access_log_for_endpoints=["/health"])
    log_config = uvicorn_config(object(), cfg).log_config
    assert log_config["handlers"]["access"]["filters"] == ["atomc_access_paths"]
    assert log_config["filters"]["atomc_access_paths"]["excluded_paths"] == ["/health"]
