"""The `atomc bench serve` run: send a random workload at a server and measure it."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from datetime import datetime

import httpx
import numpy as np
from tqdm import tqdm

from atomc.bench.client import RequestResult, fetch_models, make_http_client, send_completion
from atomc.bench.dataset import BenchRequest, sample_random_requests
from atomc.bench.metrics import DEFAULT_PERCENTILES, compute_metrics

DEFAULT_VOCAB_SIZE = 1000


@dataclass
class BenchConfig:
    base_url: str
    input_len: int
    output_len: int
    num_prompts: int
    model: str | None = None
    max_concurrency: int | None = None
    request_rate: float = math.inf
    seed: int = 0
    random_range_ratio: float = 0.0
    vocab_size: int | None = None
    api_key: str | None = None
    percentiles: Sequence[float] = DEFAULT_PERCENTILES
    show_progress: bool = True
    # requests sent (and discarded) before the measured ones, at the same concurrency, so one-time
    # costs (kernel JIT, allocator growth) land outside the measurement; their prompts come from
    # another seed, so they leave nothing in the prefix cache that the measured prompts could hit
    num_warmups: int = 0
    # more body fields for every request: `atomc bench serve --structured-json-schema FILE` puts
    # {"structured_outputs": {"json": <schema>}} here, to measure constrained decoding
    extra_body: dict | None = None


WARMUP_OUTPUT_LEN = 16
WARMUP_SEED_OFFSET = 1_000_003


async def arrivals(
    requests: Sequence[BenchRequest], request_rate: float, seed: int
) -> AsyncIterator[BenchRequest]:
    """Yield requests all at once (rate inf) or with exponential gaps, i.e. a Poisson process."""
    rng = np.random.default_rng(seed)
    for i, request in enumerate(requests):
        if i and math.isfinite(request_rate):
            await asyncio.sleep(float(rng.exponential(1.0 / request_rate)))
        yield request


async def run_requests(
    client: httpx.AsyncClient,
    cfg: BenchConfig,
    model: str,
    requests: Sequence[BenchRequest],
) -> tuple[list[RequestResult], float]:
    """Send every request, at most `max_concurrency` in flight; returns results and wall time."""
    semaphore = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    progress = tqdm(total=len(requests), disable=not cfg.show_progress, desc="requests")

    async def one(request: BenchRequest) -> RequestResult:
        if semaphore is None:
            result = await send_completion(client, cfg.base_url, model, request, cfg.api_key, cfg.extra_body)
        else:
            async with semaphore:
                result = await send_completion(client, cfg.base_url, model, request, cfg.api_key, cfg.extra_body)
        progress.update(1)
        return result

    start = time.perf_counter()
    tasks = [asyncio.create_task(one(r)) async for r in arrivals(requests, cfg.request_rate, cfg.seed)]
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    progress.close()
    return list(results), duration


def pick_model_and_vocab(cfg: BenchConfig, models: list[dict]) -> tuple[str, int]:
    """The model to ask for (the first served one unless given) and the vocab size to draw ids from:
    the option, else a `vocab_size` the server advertises on its model card, else 1000."""
    if cfg.model:
        card = next((m for m in models if m.get("id") == cfg.model), {})
        model = cfg.model
    elif models:
        card, model = models[0], models[0]["id"]
    else:
        raise RuntimeError(f"{cfg.base_url}/v1/models lists no model; pass --model")
    vocab = cfg.vocab_size or card.get("vocab_size") or DEFAULT_VOCAB_SIZE
    return model, int(vocab)


def run_fields(cfg: BenchConfig) -> dict:
    # JSON has no infinity; vLLM records an unlimited rate as the string "inf" too
    rate = cfg.request_rate if math.isfinite(cfg.request_rate) else "inf"
    return {
        "num_prompts": cfg.num_prompts,
        "max_concurrency": cfg.max_concurrency,
        "request_rate": rate,
        "input_len": cfg.input_len,
        "output_len": cfg.output_len,
        "structured_outputs": bool(cfg.extra_body and "structured_outputs" in cfg.extra_body),
    }


async def benchmark(cfg: BenchConfig) -> dict:
    """Run one benchmark and return the flat result dict (metrics plus what was run)."""
    connections = cfg.max_concurrency or cfg.num_prompts
    async with make_http_client(max_connections=connections + 1) as client:
        models: list[dict] = []
        if not (cfg.model and cfg.vocab_size):
            try:
                models = await fetch_models(client, cfg.base_url, cfg.api_key)
            except httpx.HTTPError:
                if not cfg.model:  # the model list is only optional when the model is named
                    raise
        model, vocab = pick_model_and_vocab(cfg, models)
        warmup_failed = 0
        if cfg.num_warmups:
            warm = sample_random_requests(
                cfg.num_warmups, cfg.input_len, min(cfg.output_len, WARMUP_OUTPUT_LEN), cfg.random_range_ratio,
                vocab, cfg.seed + WARMUP_SEED_OFFSET,
            )  # fmt: skip
            quiet = replace(cfg, request_rate=math.inf, show_progress=False)
            warm_results, _ = await run_requests(client, quiet, model, warm)
            warmup_failed = sum(not r.success for r in warm_results)
        requests = sample_random_requests(
            cfg.num_prompts, cfg.input_len, cfg.output_len, cfg.random_range_ratio, vocab, cfg.seed
        )
        results, duration = await run_requests(client, cfg, model, requests)
    metrics = compute_metrics(results, duration, cfg.num_prompts, cfg.percentiles)
    errors = sorted({r.error for r in results if r.error})
    return {
        "date": datetime.now().isoformat(timespec="seconds"),
        "base_url": cfg.base_url,
        "model": model,
        "vocab_size": vocab,
        **run_fields(cfg),
        "num_warmups": cfg.num_warmups,
        "warmup_failed": warmup_failed,
        **metrics,
        "errors": errors[:20],
    }


def run_benchmark(cfg: BenchConfig, timeout_s: float | None = None) -> dict:
    """One run; TimeoutError when it takes longer than `timeout_s` (its requests are cancelled)."""
    return asyncio.run(asyncio.wait_for(benchmark(cfg), timeout_s))
