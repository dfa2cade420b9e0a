"""Prometheus metrics for `GET /metrics`, named like vLLM's with an `atomc:` prefix.

Every app gets its own CollectorRegistry, so several servers in one process (tests) do not clash.
Engine gauges (running / waiting / KV usage / prefix cache) are read from the engine thread's
latest stats snapshot at scrape time; latency histograms are observed by the HTTP side as outputs
arrive, so they measure what a client sees.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from atomc.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
# routes get their own label value; anything else is "other" so random paths cannot explode cardinality
KNOWN_ROUTES = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/models",
        "/health",
        "/version",
        "/metrics",
    }
)


class EngineStatsCollector(Collector):
    """Turns `AsyncEngine.stats()` into gauges and counters at scrape time."""

    def __init__(self, stats: Callable[[], dict], healthy: Callable[[], bool]):
        self._stats, self._healthy = stats, healthy

    def collect(self):
        s = self._stats() or {}
        for name, doc, key in _ENGINE_GAUGES:
            yield GaugeMetricFamily(name, doc, value=float(s.get(key, 0)))
        queries, hits = s.get("prefix_cache_queries", 0), s.get("prefix_cache_hits", 0)
        yield CounterMetricFamily("atomc:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries)
        yield CounterMetricFamily("atomc:prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits)
        yield GaugeMetricFamily("atomc:prefix_cache_hit_rate", "Prefix-cache hits / queries.", hits / max(queries, 1))
        for name, doc, key in _ENGINE_COUNTERS:
            yield CounterMetricFamily(name, doc, float(s.get(key, 0)))
        yield GaugeMetricFamily("atomc:engine_healthy", "1 while the engine loop is alive.", float(self._healthy()))


_ENGINE_GAUGES = (
    ("atomc:num_requests_running", "Requests in the running batch.", "num_running"),
    ("atomc:num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
    ("atomc:kv_cache_usage_perc", "KV-cache usage, 0 to 1.", "kv_cache_usage"),
    ("atomc:kv_cache_free_blocks", "Free KV-cache blocks.", "num_free_blocks"),
    ("atomc:kv_cache_total_blocks", "KV-cache blocks in the pool.", "num_total_blocks"),
)


_ENGINE_COUNTERS = (
    ("atomc:num_preemptions", "Sequences preempted (KV blocks taken back, recomputed later).", "num_preemptions"),
    (
        "atomc:sampler_fallbacks",
        "Sampled rows with no finite probability left (inf/NaN logits), given their argmax instead.",
        "num_sampler_fallbacks",
    ),
    ("atomc:engine_failed_steps", "Engine steps that raised; their requests got errors.", "num_failed_steps"),
    (
        "atomc:triton_compiles_while_serving",
        "Triton kernel variants compiled after start-up (each stalled the requests in flight; the log names it).",
        "num_triton_compiles_while_serving",
    ),
)


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict], healthy: Callable[[], bool], parallel: dict | None = None):
        r = self.registry = CollectorRegistry()
        # the layout the engine runs on, as vLLM's *_config_info gauges give theirs: 1, with labels
        layout = parallel or {}
        info = Gauge(
            "atomc:parallel_config_info",
            "How the model is split: tensor_parallel_size, pipeline_parallel_size, expert_parallel.",
            list(layout),
            registry=r,
        )
        (info.labels(**{k: str(v) for k, v in layout.items()}) if layout else info).set(1)
        self.http_requests = Counter(
            "atomc:http_requests", "HTTP requests by route and status code.", ["route", "status"], registry=r
        )
        self.request_success = Counter(
            "atomc:request_success",
            "Finished generation requests by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("atomc:prompt_tokens", "Prefill tokens processed.", registry=r)
        self.generation_tokens = Counter("atomc:generation_tokens", "Generated tokens.", registry=r)
        self.ttft = Histogram(
            "atomc:time_to_first_token_seconds", "Time to first token.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "atomc:inter_token_latency_seconds",
            "Time between output tokens.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "atomc:e2e_request_latency_seconds",
            "End-to-end request latency.",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        r.register(EngineStatsCollector(stats, healthy))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def tracker(self, num_requests: int, arrival: float) -> RequestTracker:
        return RequestTracker(self, num_requests, arrival)


class RequestTracker:
    """Latency and token accounting for the engine requests behind one HTTP request."""

    def __init__(self, metrics: ServerMetrics, num_requests: int, arrival: float):
        self.m = metrics
        self.arrival = arrival
        self.pos = [0] * num_requests
        self.generated = [0] * num_requests
        self.last = [0.0] * num_requests
        self.prompt_len = [0] * num_requests
        self.done = [False] * num_requests

    def update(self, i: int, out: RequestOutput) -> None:
        now = time.perf_counter()
        self.prompt_len[i] = len(out.prompt_token_ids)
        self.generated[i] = sum(len(c.token_ids) for c in out.outputs)
        # latency follows the longest of the n samples: they advance together, one token per step
        pos = max((len(c.token_ids) for c in out.outputs), default=0)
        new = pos - self.pos[i]
        if new > 0:
            if self.pos[i] == 0:
                self.m.ttft.observe(now - self.arrival)
                gaps, gap = new - 1, 0.0  # tokens that came together with the first one
            else:
                # several tokens in one update (a slow reader): spread the gap over them
                gaps, gap = new, (now - self.last[i]) / new
            for _ in range(gaps):
                self.m.itl.observe(gap)
            self.pos[i], self.last[i] = pos, now
        if out.finished and not self.done[i]:
            reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "stop")
            self._finish(i, reason, now)

    def close(self) -> None:
        """Count requests that ended without a finished output (client gone, engine failure)."""
        now = time.perf_counter()
        for i, done in enumerate(self.done):
            if not done:
                self._finish(i, "abort", now)

    def _finish(self, i: int, reason: str, now: float) -> None:
        self.done[i] = True
        self.m.request_success.labels(finished_reason=reason).inc()
        self.m.prompt_tokens.inc(self.prompt_len[i])
        self.m.generation_tokens.inc(self.generated[i])
        self.m.e2e.observe(now - self.arrival)


class HTTPMetricsMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, which would buffer and break streaming cancellation)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope.get("path", "") if scope.get("path") in KNOWN_ROUTES else "other"
        status = [500]

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.http_requests.labels(route=route, status=str(status[0])).inc()
