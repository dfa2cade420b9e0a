"""One streaming POST /v1/completions request, timed chunk by chunk."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from atomc.bench.dataset import BenchRequest

SSE_DONE = "[DONE]"


@dataclass
class RequestResult:
    """What one request measured; times are seconds from the moment the request was sent."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""


def make_http_client(max_connections: int | None, read_timeout_s: float = 600.0) -> httpx.AsyncClient:
    """An AsyncClient sized for the run: one connection per concurrent request, no pool timeout
    (the semaphore is what queues requests), a read timeout that only trips on a stalled stream."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    timeout = httpx.Timeout(connect=30.0, read=read_timeout_s, write=60.0, pool=None)
    # trust_env=False: a proxy picked up from the environment would sit inside every measured latency
    return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def fetch_models(client: httpx.AsyncClient, base_url: str, api_key: str | None = None) -> list[dict]:
    """The `data` list of GET /v1/models (each entry has at least an `id`)."""
    resp = await client.get(f"{base_url.rstrip('/')}/v1/models", headers=auth_headers(api_key))
    resp.raise_for_status()
    return list(resp.json().get("data") or [])


def parse_sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line; None for blank lines, comments and other fields."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    return line[len("data:"):].strip()


def completion_payload(model: str, request: BenchRequest, extra: dict | None = None) -> dict:
    """`extra`: more body fields (a `structured_outputs` constraint for every request, say)."""
    # ignore_eos makes every request produce exactly max_tokens, so runs are comparable
    return (extra or {}) | {
        "model": model,
        "prompt": request.prompt_ids,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def chunk_token_count(chunk: dict) -> int:
    """How many generated tokens a stream chunk carries: 0 for role/usage/empty chunks."""
    choices = chunk.get("choices") or []
    if not choices:
        return 0
    choice = choices[0]
    if choice.get("token_ids"):
        return len(choice["token_ids"])
    return 1 if choice.get("text") else 0


async def send_completion(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    request: BenchRequest,
    api_key: str | None = None,
    extra: dict | None = None,
) -> RequestResult:
    """Send one streaming completion and time it. Never raises for a server or transport error:
    those come back as `success=False` so one bad request cannot end a long run."""
    result = RequestResult(prompt_len=request.prompt_len)
    url = f"{base_url.rstrip('/')}/v1/completions"
    usage_tokens: int | None = None
    chunk_tokens = 0
    start = last = time.perf_counter()
    try:
        async with client.stream(
            "POST", url, json=completion_payload(model, request, extra), headers=auth_headers(api_key)
        ) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:300]}"
                return result
            async for line in resp.aiter_lines():
                data = parse_sse_data(line)
                if not data:
                    continue
                if data == SSE_DONE:
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    result.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return result
                n = chunk_token_count(chunk)
                if n:
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunk_tokens += n
                usage = chunk.get("usage") or {}
                if usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
    except Exception as exc:  # transport, protocol and JSON errors all mean "this request failed"
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    if result.ttft is None:
        result.error = "stream ended without any generated token"
        return result
    # the server's usage is authoritative; counting chunks undercounts when one chunk holds several tokens
    result.output_tokens = usage_tokens if usage_tokens is not None else chunk_tokens
    result.success = True
    return result
