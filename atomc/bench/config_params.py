"""The `params` block of a CVS ATOM config: each field parsed, defaulted, or rejected by name.

Every field of the page's `params` is either honoured or refused with a message naming it, so
nothing in a lab's file is silently dropped; `PARAMS` maps each name to its parser and default
(what each does here is the table in docs/benchmarking.md). The server and client waits are
turned into the two timeouts the suite uses.
"""

from __future__ import annotations

import math
import re

from atomc.bench.config_file import SweepConfigError

NATIVE_DRIVERS = ("atom", "atomc")  # the server is `atomc serve`, started by the suite
EXTERNAL_DRIVERS = ("vllm_atom", "sglang", "vllm")  # a server the user starts; reached through --base-url


def _int(value, name: str, minimum: int = 0) -> int:
    try:
        n = int(str(value).strip())
    except (TypeError, ValueError):
        raise SweepConfigError(f"params.{name} must be an integer, got {value!r}") from None
    if n < minimum:
        raise SweepConfigError(f"params.{name} must be >= {minimum}, got {n}")
    return n


def _float(value, name: str, minimum: float = 0.0) -> float:
    try:
        x = float(str(value).strip())
    except (TypeError, ValueError):
        raise SweepConfigError(f"params.{name} must be a number, got {value!r}") from None
    if math.isnan(x) or x < minimum:
        raise SweepConfigError(f"params.{name} must be >= {minimum:g}, got {value!r}")
    return x


def _bool(value, name: str) -> bool:
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no", ""):
        return False
    raise SweepConfigError(f"params.{name} must be true or false, got {value!r}")


def _only(allowed: tuple[str, ...], why: str):
    def check(value, name: str) -> str:
        text = str(value).strip()
        if text not in allowed:
            raise SweepConfigError(f"params.{name}={value!r} is not supported: {why}")
        return text

    return check


def _percentile_metrics(value, name: str) -> str:
    families = {v.strip() for v in str(value).split(",") if v.strip()}
    unknown = families - {"ttft", "tpot", "itl", "e2el"}
    if unknown:
        raise SweepConfigError(
            f"params.{name}: unknown metric families {sorted(unknown)} (known: ttft, tpot, itl, e2el)"
        )
    return str(value)


def _metric_percentiles(value, name: str) -> str:
    for part in str(value).split(","):
        if part.strip():
            p = _float(part, name)
            if not 0 < p < 100:
                raise SweepConfigError(f"params.{name}: percentiles lie in (0, 100), got {part.strip()}")
    return str(value)


def _empty(why: str):
    def check(value, name: str) -> str:
        if str(value).strip():
            raise SweepConfigError(f"params.{name}={value!r} is not supported: {why}")
        return ""

    return check


def _exactly(expected: float, why: str):
    def check(value, name: str) -> float:
        x = _float(value, name)
        if x != expected:
            raise SweepConfigError(f"params.{name}={value!r} is not supported: {why}")
        return x

    return check


# name -> (parse(value, name) -> value, default). What each one does is in docs/benchmarking.md.
PARAMS = {
    "driver": (
        _only(NATIVE_DRIVERS + EXTERNAL_DRIVERS, "drivers are atom (atomc serve), vllm_atom, sglang, vllm"),
        "atom",
    ),
    "backend": (
        _only(("vllm", "openai"), "atomc bench speaks the OpenAI completions API (backend vllm/openai)"),
        "vllm",
    ),
    "base_url": (lambda v, n: str(v).strip(), ""),
    "port_no": (lambda v, n: _int(v, n, 1), None),
    "dataset_name": (_only(("random",), "atomc bench only draws random token-id prompts"), "random"),
    "burstiness": (_exactly(1.0, "arrivals are Poisson (burstiness 1.0) only"), 1.0),
    "seed": (lambda v, n: _int(v, n), 0),
    "request_rate": (lambda v, n: _rate(v, n), math.inf),
    "random_range_ratio": (lambda v, n: _float(v, n), 0.0),
    "random_prefix_len": (_exactly(0.0, "prompts share no fixed prefix in atomc bench"), 0),
    "tensor_parallelism": (lambda v, n: _int(v, n, 1), 1),
    "pipeline_parallel_size": (lambda v, n: _int(v, n, 1), 1),
    "nnodes": (lambda v, n: _int(v, n, 1), 1),
    "master_addr": (lambda v, n: str(v).strip(), ""),
    "master_port": (lambda v, n: _int(v, n, 1), 29501),
    "tokenizer_mode": (_only(("auto",), "prompts are token ids; no tokenizer is used"), "auto"),
    "percentile_metrics": (_percentile_metrics, "ttft,tpot,itl,e2el"),
    "metric_percentiles": (_metric_percentiles, ""),
    "num_prompts": (lambda v, n: _int(v, n, 1), None),
    "max_model_length": (lambda v, n: _int(v, n, 1), None),
    "num_warmups": (lambda v, n: _int(v, n), 0),
    "client_initial_wait_s": (lambda v, n: _float(v, n), 120.0),
    "client_poll_count": (lambda v, n: _int(v, n, 1), 50),
    "client_poll_wait_time": (lambda v, n: _float(v, n), 60.0),
    "server_precheck_wait_s": (lambda v, n: _float(v, n), 30.0),
    "server_warmup_wait_s": (lambda v, n: _float(v, n), 330.0),
    "server_poll_count": (lambda v, n: _int(v, n, 1), 60),
    "server_poll_wait_time": (lambda v, n: _float(v, n), 60.0),
    "server_ready_timeout_s": (lambda v, n: _float(v, n), None),
    "reuse_server_across_sweep": (_bool, None),
    "bench_max_failed_requests": (lambda v, n: _int(v, n), None),
    "bench_extra_args": (_empty("atomc bench takes no extra client flags; use the params fields"), ""),
    "result_filename": (lambda v, n: _safe_name(v, n), "results"),
    "scaling_baseline_output_throughput": (lambda v, n: _float(v, n) if str(v).strip() else None, None),
}


def _rate(value, name: str) -> float:
    x = _float(value, name)
    if x == 0:
        raise SweepConfigError(f"params.{name} must be > 0 requests/s or inf, got {value!r}")
    return x


def _safe_name(value, name: str) -> str:
    text = str(value).strip()
    if not re.fullmatch(r"[A-Za-z0-9._-]+", text):
        raise SweepConfigError(f"params.{name} must be a plain file name, got {value!r}")
    return text


def parse_params(raw: dict) -> dict:
    unknown = sorted(set(raw) - set(PARAMS))
    if unknown:
        raise SweepConfigError(f"unknown params {unknown}; known: {', '.join(sorted(PARAMS))}")
    out = {}
    for name, (parse, default) in PARAMS.items():
        value = raw.get(name)
        out[name] = default if value is None else parse(value, name)
    return out


def server_ready_timeout_s(params: dict) -> float:
    """How long a server may take to answer /health: CVS's precheck + warm-up waits plus its poll
    budget (count x wait); `server_ready_timeout_s` (atomc's own) replaces the sum when set."""
    if params["server_ready_timeout_s"] is not None:
        return params["server_ready_timeout_s"]
    return (
        params["server_precheck_wait_s"]
        + params["server_warmup_wait_s"]
        + params["server_poll_count"] * params["server_poll_wait_time"]
    )


def client_timeout_s(params: dict) -> float:
    """How long one cell's client run may take before it is cut off (CVS: initial wait + polls)."""
    return params["client_initial_wait_s"] + params["client_poll_count"] * params["client_poll_wait_time"]
