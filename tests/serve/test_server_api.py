"""The OpenAI-compatible server end to end: a real uvicorn on loopback, a tiny llama, the official client.

The model loads once per module; every test talks HTTP to it. Tests that care about KV blocks check
the engine's own stats (through the engine thread's snapshot) after the HTTP side is done.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from atomc.config import EngineConfig
from atomc.serve.server import ServerThread, build_server_app

MAX_MODEL_LEN = 256


def make_config(model_dir, **serve) -> EngineConfig:
    cfg = EngineConfig(device="cpu")
    cfg.model.model = str(model_dir)
    cfg.model.max_model_len = MAX_MODEL_LEN
    cfg.compile.enforce_eager = True
    cfg.cache.num_kv_blocks = 512  # 64 streams x ~3 blocks each fit without preemption
    cfg.scheduler.max_num_seqs = 64
    cfg.serve.engine_process = "on"  # this suite runs through the engine process; the errors suite, a thread
    for k, v in serve.items():
        setattr(cfg.serve, k, v)
    return cfg


@pytest.fixture(scope="module")
def server(llama_dir):
    app = build_server_app(make_config(llama_dir))
    with ServerThread(app, app.state.atomc.config) as st:
        st.state = app.state.atomc
        yield st


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(server) -> str:
    return server.state.model_name


def wait_pool_free(server, timeout: float = 5.0) -> dict:
    """Poll the engine stats until nothing runs and every KV block is free again."""
    deadline = time.monotonic() + timeout
    while True:
        s = server.state.aengine.stats()
        idle = s["num_running"] == 0 and s["num_waiting"] == 0
        if idle and s["num_free_blocks"] == s["num_total_blocks"]:
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"KV pool not free after {timeout}s: {s}")
        time.sleep(0.02)


def wait_for(cond, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def greedy(client, model, prompt="The capital of France", max_tokens=12, **kw):
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)


# ---------------------------------------------------------------- plain endpoints


def test_models_version_health(server, client, model):
    models = client.models.list().data
    assert [m.id for m in models] == [model]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert "version" in httpx.get(server.base_url + "/version").json()


# ---------------------------------------------------------------- completions


def test_completion_greedy_and_usage(client, model):
    r = greedy(client, model, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == model
    (choice,) = r.choices
    assert choice.index == 0 and choice.finish_reason == "length" and isinstance(choice.text, str)
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    # greedy is deterministic, and a repeated prompt can come from the prefix cache
    again = greedy(client, model, extra_body={"ignore_eos": True})
    assert again.choices[0].text == choice.text


def test_prompt_forms(client, model, server):
    ids = server.state.engine.tokenize("The capital of France")
    by_text = greedy(client, model, max_tokens=6, extra_body={"ignore_eos": True})
    by_ids = greedy(client, model, prompt=ids, max_tokens=6, extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = greedy(client, model, prompt=["The capital of France", "Once upon"], max_tokens=6)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == by_text.choices[0].text
    many_ids = greedy(client, model, prompt=[ids, ids[:3]], max_tokens=6)
    assert len(many_ids.choices) == 2 and many_ids.choices[0].text == by_text.choices[0].text


def test_n_and_seed(client, model):
    kw = dict(model=model, prompt="Once upon a time", max_tokens=10, temperature=1.0, n=3)
    a = client.completions.create(seed=1234, **kw)
    b = client.completions.create(seed=1234, **kw)
    c = client.completions.create(seed=99, **kw)
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert [ch.text for ch in a.choices] != [ch.text for ch in c.choices]
    assert 3 <= a.usage.completion_tokens <= 30


def test_logprobs_and_echo(client, model):
    r = greedy(client, model, max_tokens=5, logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and 2 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(value)  # greedy picks the most likely token
        assert tok in top
    assert lp.text_offset == sorted(lp.text_offset)

    prompt = "The capital of France"
    e = greedy(client, model, prompt=prompt, max_tokens=5, echo=True, logprobs=1, extra_body={"ignore_eos": True})
    assert e.choices[0].text == prompt + r.choices[0].text
    elp = e.choices[0].logprobs
    assert len(elp.tokens) == e.usage.prompt_tokens + 5
    assert elp.token_logprobs[0] is None  # nothing predicts the first prompt token
    assert elp.token_logprobs[-5:] == pytest.approx(lp.token_logprobs)


def test_echo_logprobs_score_the_prompt(client, model):
    r = greedy(client, model, max_tokens=1, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    n_prompt = r.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1 : n_prompt + 1])
    assert all(len(top) >= 1 for top in lp.top_logprobs[1:])


def test_stop_string(client, model):
    full = greedy(client, model, max_tokens=16, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[5:8]
    assert stop.strip()
    r = greedy(client, model, max_tokens=16, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].model_extra["stop_reason"] == stop
    # streamed, the text never shows a stop string that a later token completes
    chunks = client.completions.create(
        model=model, prompt="The capital of France", max_tokens=16, temperature=0, stop=[stop], stream=True
    )
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_sampling_fields_accepted(client, model):
    r = client.completions.create(
        model=model,
        prompt="Hello",
        max_tokens=4,
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        seed=7,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True},
    )
    assert r.usage.completion_tokens == 4


def test_stream_matches_non_stream(client, model):
    want = greedy(client, model, max_tokens=12, extra_body={"ignore_eos": True}).choices[0].text
    chunks = list(
        client.completions.create(
            model=model,
            prompt="The capital of France",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    *body, last = chunks
    assert "".join(c.choices[0].text for c in body) == want
    assert body[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert last.choices == [] and last.usage.completion_tokens == 12


def test_stream_n_many_prompts(client, model):
    stream = client.completions.create(
        model=model, prompt=["a b c", "hello"], max_tokens=5, n=2, temperature=1.0, seed=3, stream=True
    )
    texts, finished = {}, set()
    for chunk in stream:
        (c,) = chunk.choices
        texts[c.index] = texts.get(c.index, "") + c.text
        if c.finish_reason:
            finished.add(c.index)
    assert finished == {0, 1, 2, 3}


def test_raw_sse_format(server, model):
    body = {"model": model, "prompt": "Hi", "max_tokens": 3, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


# ---------------------------------------------------------------- chat


def test_chat(client, model):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert r.usage.prompt_tokens > 0 and 1 <= r.usage.completion_tokens <= 6

    parts = [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]
    same = client.chat.completions.create(model=model, messages=[messages[0], *parts], max_tokens=6, temperature=0)
    assert same.choices[0].message.content == msg.content

    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_chat_logprobs_n(client, model):
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "count"}],
        max_completion_tokens=4,
        n=2,
        seed=5,
        temperature=1.0,
        logprobs=True,
        top_logprobs=3,
    )
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        content = c.logprobs.content
        assert 1 <= len(content) <= 4
        assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


# ---------------------------------------------------------------- load, disconnects, metrics


def test_64_concurrent_streams_free_the_pool(server, model):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await client.completions.create(
            model=model,
            prompt=f"request number {i}: once upon a time",
            max_tokens=16,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        finish, tokens = None, 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return finish, tokens

    async def main():
        limits = httpx.Limits(max_connections=100)
        async with openai.AsyncOpenAI(
            base_url=server.base_url + "/v1",
            api_key="unused",
            max_retries=0,
            timeout=120,
            http_client=httpx.AsyncClient(limits=limits),
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    assert results == [("length", 16)] * 64
    wait_pool_free(server)


@pytest.fixture
def aborted(server, monkeypatch) -> list[str]:
    """Request ids the engine thread aborted during the test."""
    engine, calls = server.state.engine, []
    real = engine.abort_request

    def record(request_id):
        calls.append(request_id)
        return real(request_id)

    monkeypatch.setattr(engine, "abort_request", record)
    return calls


def test_disconnect_mid_stream_aborts(server, model, aborted):
    body = {"model": model, "prompt": "Once", "max_tokens": 240, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        first = next(lines)
        assert first.startswith("data: ")
        request_id = json.loads(first[6:])["id"]
    # closed after one token: the engine drops the request and frees its blocks at once
    wait_for(lambda: aborted == [request_id])
    wait_pool_free(server)


def test_disconnect_non_streaming_aborts(server, model, aborted):
    body = {"model": model, "prompt": "Once", "max_tokens": 240, "ignore_eos": True, "n": 4}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=0.3)
    wait_for(lambda: len(aborted) == 1 and aborted[0].startswith("cmpl-"))
    wait_pool_free(server)


def test_metrics(server, client, model):
    greedy(client, model, max_tokens=3)
    text = httpx.get(server.base_url + "/metrics").text
    for name in (
        "atomc:num_requests_running",
        "atomc:num_requests_waiting",
        "atomc:kv_cache_usage_perc",
        "atomc:prefix_cache_hit_rate",
        "atomc:prefix_cache_queries_total",
        "atomc:time_to_first_token_seconds_bucket",
        "atomc:inter_token_latency_seconds_bucket",
        "atomc:e2e_request_latency_seconds_bucket",
        "atomc:prompt_tokens_total",
        "atomc:generation_tokens_total",
        "atomc:num_preemptions_total",
        "atomc:sampler_fallbacks_total",
        "atomc:engine_failed_steps_total",
    ):
        assert name in text, name
    values = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert values['atomc:http_requests_total{route="/v1/completions",status="200"}'] > 0
    assert values["atomc:generation_tokens_total"] > 0
    layout = 'atomc:parallel_config_info{expert_parallel="false",pipeline_parallel_size="1",tensor_parallel_size="1"}'
    assert values[layout] == 1
    assert values["atomc:time_to_first_token_seconds_count"] > 0
    assert values["atomc:prefix_cache_hits_total"] > 0  # repeated prompts above
