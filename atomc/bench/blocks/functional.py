"""FUNC-1 / FUNC-2: is the server under test answering, and does its OpenAI API behave?

Run before the sweep on the fresh server, so a broken API is reported as such instead of as a
sweep of failed requests. Each check is one row; the block FAILs when any row fails. Plain HTTP
(httpx) against the routes every OpenAI-compatible server has, so --base-url runs against vLLM or
SGLang check the same things.
"""

from __future__ import annotations

import json
import time

import httpx

from atomc.bench.blocks import BlockResult, SuiteContext
from atomc.bench.client import auth_headers, parse_sse_data

TIMEOUT_S = 120.0


def _client(ctx: SuiteContext) -> httpx.Client:
    return httpx.Client(base_url=ctx.base_url, headers=auth_headers(ctx.api_key), timeout=TIMEOUT_S, trust_env=False)


def _check(rows: list[dict], name: str, fn, advisory: bool = False) -> None:
    """Run one check into a row. An advisory check is reported but never fails the block."""
    start = time.perf_counter()
    try:
        detail = fn()
        ok = True
    except Exception as exc:  # any failure of one check is that check's FAIL
        ok, detail = False, f"{type(exc).__name__}: {exc}"
    ms = round((time.perf_counter() - start) * 1e3, 1)
    rows.append({"check": name, "ok": ok, "advisory": advisory, "detail": str(detail)[:300], "ms": ms})


def _verdict(block: str, rows: list[dict]) -> BlockResult:
    failed = [r["check"] for r in rows if not r["ok"] and not r["advisory"]]
    advised = [r["check"] for r in rows if not r["ok"] and r["advisory"]]
    metrics = {"checks": float(len(rows)), "failed_checks": float(len(failed))}
    note = f" (advisory, not met: {', '.join(advised)})" if advised else ""
    if failed:
        return BlockResult(block, "FAIL", f"failed: {', '.join(failed)}{note}", metrics, rows)
    return BlockResult(block, "PASS", f"{len(rows) - len(advised)} checks passed{note}", metrics, rows)


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def run_health_check(spec: dict, ctx: SuiteContext) -> BlockResult:
    """FUNC-2: GET /health answers 200 and /v1/models lists the model under test."""
    rows: list[dict] = []
    with _client(ctx) as http:

        def health():
            r = http.get("/health")
            _expect(r.status_code == 200, f"GET /health answered {r.status_code}")
            return "200"

        def models():
            r = http.get("/v1/models")
            _expect(r.status_code == 200, f"GET /v1/models answered {r.status_code}")
            ids = [m.get("id") for m in r.json().get("data") or []]
            _expect(ctx.model in ids, f"{ctx.model!r} not among served models {ids}")
            return f"serves {ids}"

        _check(rows, "health", health)
        _check(rows, "models", models)
    return _verdict("functional.health_check", rows)


def run_api_smoke(spec: dict, ctx: SuiteContext) -> BlockResult:
    """FUNC-1: one completion, one chat completion and one streamed completion return text, usage
    and a proper end; advisory: a request for an unknown model is refused with a 4xx error object."""
    prompt = str(spec.get("prompt", "The capital of France is"))
    max_tokens = int(spec.get("max_tokens", 8))
    rows: list[dict] = []
    with _client(ctx) as http:

        def completion():
            body = {"model": ctx.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            r = http.post("/v1/completions", json=body)
            _expect(r.status_code == 200, f"POST /v1/completions answered {r.status_code}: {r.text[:200]}")
            data = r.json()
            choice = (data.get("choices") or [{}])[0]
            _expect(isinstance(choice.get("text"), str), "no choices[0].text")
            _expect((data.get("usage") or {}).get("completion_tokens", 0) >= 1, "usage.completion_tokens < 1")
            _expect(choice.get("finish_reason") in ("stop", "length"), f"finish_reason {choice.get('finish_reason')!r}")
            return repr(choice["text"][:60])

        def chat():
            body = {"model": ctx.model, "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens, "temperature": 0}  # fmt: skip
            r = http.post("/v1/chat/completions", json=body)
            _expect(r.status_code == 200, f"POST /v1/chat/completions answered {r.status_code}: {r.text[:200]}")
            message = ((r.json().get("choices") or [{}])[0]).get("message") or {}
            _expect(message.get("role") == "assistant", f"message role {message.get('role')!r}")
            _expect(isinstance(message.get("content"), str), "no message.content")
            return repr(message["content"][:60])

        def stream():
            body = {"model": ctx.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
            chunks, done = 0, False
            with http.stream("POST", "/v1/completions", json=body) as r:
                _expect(r.status_code == 200, f"streamed POST /v1/completions answered {r.status_code}")
                for line in r.iter_lines():
                    data = parse_sse_data(line)
                    if data == "[DONE]":
                        done = True
                        break
                    if data:
                        json.loads(data)  # every event is JSON
                        chunks += 1
            _expect(chunks >= 1, "no data events")
            _expect(done, "stream did not end with [DONE]")
            return f"{chunks} events, [DONE]"

        def unknown_model():
            body = {"model": "atomc-bench-no-such-model", "prompt": prompt, "max_tokens": 1}
            r = http.post("/v1/completions", json=body)
            _expect(400 <= r.status_code < 500, f"answered {r.status_code}, expected a 4xx")
            _expect("error" in r.json(), "no error object in the body")
            return str(r.status_code)

        for name, fn in (("completion", completion), ("chat", chat), ("stream", stream)):
            _check(rows, name, fn)
        # advisory: some servers (SGLang) serve any model name, which is no broken API
        _check(rows, "unknown_model", unknown_model, advisory=True)
    return _verdict("functional.api_smoke", rows)
