"""Every bad input gets an OpenAI-shaped error with the right status, and none of them crashes the
server or leaks a KV block. Also: engine failure (500 / 503, never a hang), SIGTERM drain, and the
parent-death guard, the last two in real subprocesses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from atomc.config import EngineConfig
from atomc.engine.client import EngineClient
from atomc.outputs import CompletionOutput, RequestOutput
from atomc.serve.api import build_app
from atomc.serve.async_engine import AsyncEngine
from atomc.serve.server import ServerThread, build_server_app

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-test-key"
BODY_LIMIT = 64 * 1024


def make_config(model_dir, max_model_len: int = 128) -> EngineConfig:
    cfg = EngineConfig(device="cpu")
    cfg.model.model = str(model_dir)
    cfg.model.max_model_len = max_model_len
    cfg.compile.enforce_eager = True
    cfg.cache.num_kv_blocks = 64
    cfg.serve.api_key = KEY
    cfg.serve.max_request_bytes = BODY_LIMIT
    return cfg


@pytest.fixture(scope="module")
def server(llama_dir):
    app = build_server_app(make_config(llama_dir))
    with ServerThread(app, app.state.atomc.config) as st:
        st.state = app.state.atomc
        yield st


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def model(server) -> str:
    return server.state.model_name


def assert_error(r: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "any":
        assert err["param"] == param, err
    return err


def pool_is_free(server, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        s = server.state.aengine.stats()
        if s["num_running"] == s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_total_blocks"]:
            return
        assert time.monotonic() < deadline, s
        time.sleep(0.02)


# ---------------------------------------------------------------- 400: invalid parameters

COMPLETION_CASES = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -7}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"n": 0}, "n"),
    ({"n": -1}, "n"),
    ({"n": 100000}, "n"),
    ({"n": "two"}, "n"),
    ({"logprobs": 50}, "logprobs"),
    ({"stop": [""]}, "stop"),
    ({"seed": 2**70}, "seed"),
    ({"seed": 2**63}, "seed"),  # past int64
    ({"temperature": "hot"}, "temperature"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["ok", ""]}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1] * 200}, "prompt"),  # longer than the 128-token context
    ({"prompt": "hello", "max_tokens": 1000}, "prompt"),  # prompt + max_tokens over the context
    ({"prompt": [10**9]}, "prompt"),  # not a token id of this vocabulary
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"suffix": "tail"}, "suffix"),
    ({"best_of": 1, "n": 2}, "best_of"),  # fewer samples than it returns
    ({"best_of": 2, "stream": True}, "best_of"),  # the best are known only at the end
    ({"logit_bias": {"10000000": 10}}, "logit_bias"),  # not a token id of this vocabulary
    ({"logit_bias": {"x": 10}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),  # past the context
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stop_token_ids": [-4]}, "stop_token_ids"),
]


@pytest.mark.parametrize(("fields", "param"), COMPLETION_CASES, ids=[str(c[0])[:40] for c in COMPLETION_CASES])
def test_completion_400(http, model, fields, param):
    body = {"model": model, "prompt": "hello", "max_tokens": 4, **fields}
    if body["prompt"] is None:
        del body["prompt"]
    err = assert_error(http.post("/v1/completions", json=body), 400, param)
    assert err["type"] == "invalid_request_error"


CHAT_CASES = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 500}, "messages"),  # prompt + max_tokens over the context
    ({"temperature": -1}, "temperature"),
    ({"n": 0}, "n"),
    # tools default to tool_choice "auto", which this server (no --enable-auto-tool-choice) refuses
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": ""}}], "tool_choice": "none"}, "tools"),
    ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages"),
    ({"logit_bias": {"10000000": 1}}, "logit_bias"),
    ({"best_of": 1, "n": 2}, "best_of"),
]


@pytest.mark.parametrize(("fields", "param"), CHAT_CASES, ids=[str(c[0])[:40] for c in CHAT_CASES])
def test_chat_400(http, model, fields, param):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    assert_error(http.post("/v1/chat/completions", json=body), 400, param)


def test_openai_client_sees_typed_errors(server, model):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="hi", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0).models.list()


# ---------------------------------------------------------------- 401 / 404 / 405 / 413 / 422


def test_api_key(server, model):
    body = {"model": model, "prompt": "hi", "max_tokens": 2}
    url = server.base_url + "/v1/completions"
    assert_error(httpx.post(url, json=body), 401)
    assert_error(httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}), 401)
    assert_error(httpx.post(url, json=body, headers={"Authorization": f"Basic {KEY}"}), 401)
    assert_error(httpx.get(server.base_url + "/v1/models"), 401)
    assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    # operational endpoints stay open, as in vLLM: probes and scrapers carry no key
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/metrics").status_code == 200


def test_unknown_model_and_route(http, model):
    err = assert_error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404, "model")
    assert err["code"] == "model_not_found"
    chat = {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}
    assert_error(http.post("/v1/chat/completions", json=chat), 404, "model")
    assert_error(http.get("/v1/nothing-here"), 404)
    assert_error(http.get("/v1/completions"), 405)


def test_body_too_large(http, model):
    big = {"model": model, "prompt": "x" * (BODY_LIMIT + 10)}
    assert_error(http.post("/v1/completions", json=big), 413)

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(BODY_LIMIT // 1000 + 5):
            yield b" " * 1000

    assert_error(http.post("/v1/completions", content=chunks()), 413)


@pytest.mark.parametrize("raw", [b"{bad json", b"", b'{"prompt": "hi",}', b"\xff\xfe\x00"])
def test_malformed_json_400(http, raw):
    # OpenAI's and vLLM's status for a body that is not JSON (FastAPI's own would be 422)
    err = assert_error(http.post("/v1/completions", content=raw, headers={"content-type": "application/json"}), 400)
    assert err["code"] == "invalid_json"
    assert_error(http.post("/v1/chat/completions", content=raw), 400)


def test_json_that_is_not_an_object(http):
    assert_error(http.post("/v1/completions", json=[1, 2, 3]), 400)


# ---------------------------------------------------------------- hostile values: a 400, never a dead server

# each of these once aborted the whole process (or left it answering 503 forever): NaN / Infinity
# are valid to Python's JSON parser; the finite ones overflow or underflow float32 in the sampler
HOSTILE_FLOATS = [
    ("temperature", "NaN"),
    ("temperature", "Infinity"),
    ("temperature", "1e39"),
    ("top_p", "5e-324"),
    ("top_p", "NaN"),
    ("repetition_penalty", "1e-46"),
    ("repetition_penalty", "-Infinity"),
    ("min_p", "NaN"),
    ("presence_penalty", "NaN"),
    ("frequency_penalty", "Infinity"),
]


@pytest.mark.parametrize(("field", "raw"), HOSTILE_FLOATS, ids=[f"{f}={v}" for f, v in HOSTILE_FLOATS])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_hostile_floats_are_400_and_the_server_keeps_serving(http, model, route, field, raw):
    prompt = '"prompt": "hi"' if route == "/v1/completions" else '"messages": [{"role": "user", "content": "hi"}]'
    body = f'{{"model": "{model}", "max_tokens": 3, {prompt}, "{field}": {raw}}}'
    err = assert_error(http.post(route, content=body, headers={"content-type": "application/json"}), 400, field)
    assert field in err["message"]
    ok = http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2, "temperature": 0.9})
    assert ok.status_code == 200, ok.text


def test_lone_surrogates_are_400(http, model):
    raw = f'{{"model": "{model}", "prompt": "a\\ud800b", "max_tokens": 2}}'
    assert_error(http.post("/v1/completions", content=raw), 400, "prompt")
    chat = f'{{"model": "{model}", "messages": [{{"role": "user", "content": "\\udfff"}}]}}'
    assert_error(http.post("/v1/chat/completions", content=chat), 400, "messages")
    stop = f'{{"model": "{model}", "prompt": "hi", "stop": ["\\ud83d"]}}'
    assert_error(http.post("/v1/completions", content=stop), 400, "stop")


@pytest.mark.parametrize("depth", [40, 1000, 30_000])  # 30,000: under the body limit
def test_deep_json_is_400(http, model, depth):
    raw = f'{{"model": "{model}", "prompt": {"[" * depth}1{"]" * depth}}}'
    err = assert_error(http.post("/v1/completions", content=raw), 400)
    assert "nested" in err["message"]


def test_limits_on_work_per_request(http, model, server, monkeypatch):
    limits = server.state.limits
    many = {"model": model, "prompt": ["hi"] * (limits.max_prompts + 1), "max_tokens": 1}
    err = assert_error(http.post("/v1/completions", json=many), 400, "prompt")
    assert "--max-prompts-per-request" in err["message"]
    # the case from the issue: a small body fanning out to a huge number of sequences
    fan = {"model": model, "prompt": ["a"] * 100, "n": 100, "max_tokens": 1}
    err = assert_error(http.post("/v1/completions", json=fan), 400, "n")
    assert "--max-seqs-per-request" in err["message"]
    # echo + logprobs scores every prompt token of every choice: the response is bounded too
    monkeypatch.setattr(server.state, "limits", dataclasses.replace(limits, max_logprob_entries=10_000))
    scored = {"model": model, "prompt": ["word " * 20] * 10, "echo": True, "logprobs": 20, "max_tokens": 1}
    err = assert_error(http.post("/v1/completions", json=scored), 400, "logprobs")
    assert "--max-logprob-entries-per-request" in err["message"]
    scored["prompt"] = ["word " * 20] * 2  # 2 x (102 + 1) tokens x 21 entries fit
    assert http.post("/v1/completions", json=scored).status_code == 200


def test_internal_errors_do_not_echo_the_exception(server, http, model, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("secret /internal/path detail")

    monkeypatch.setattr(server.state, "check_model", boom)
    err = assert_error(http.post("/v1/completions", json={"model": model, "prompt": "hi"}), 500)
    assert "secret" not in err["message"] and err["type"] == "server_error"


def test_openapi_declares_the_request_models_and_follows_the_key(server, http):
    assert httpx.get(server.base_url + "/openapi.json").status_code == 401
    assert httpx.get(server.base_url + "/docs").status_code == 401
    assert httpx.get(server.base_url + "/redoc").status_code == 401
    doc = http.get("/openapi.json").json()
    routes = [
        ("/v1/completions", "CompletionRequest", {"temperature", "max_tokens", "n"}),
        ("/v1/chat/completions", "ChatCompletionRequest", {"temperature", "max_tokens", "n"}),
        ("/v1/responses", "ResponsesRequest", {"input", "instructions", "max_output_tokens", "tools"}),
        ("/v1/messages", "AnthropicMessagesRequest", {"messages", "system", "max_tokens", "stop_sequences"}),
    ]
    for path, model, fields in routes:
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        schema = doc["components"]["schemas"][model]
        assert fields <= set(schema["properties"])
    # nested models resolve inside the document
    assert {"ChatMessage", "AnthropicMessage"} <= set(doc["components"]["schemas"])
    assert http.get("/docs").status_code == 200


def test_slow_body_times_out(server, model, monkeypatch):
    monkeypatch.setattr(server.state.config.serve, "request_body_timeout_s", 0.5)
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: 1000\r\n\r\n"
        )
        s.sendall(head.encode() + b'{"prompt": ')  # and never the rest
        t0 = time.monotonic()
        reply = s.recv(4096).decode()
        assert reply.startswith("HTTP/1.1 408"), reply
        assert time.monotonic() - t0 < 5


def test_models_lists_the_folder_name_not_a_path(http, server):
    card = http.get("/v1/models").json()["data"][0]
    assert card["id"] == Path(server.state.config.model.model).name == card["root"]
    assert "/" not in card["id"] + card["root"]
    # the --model value itself is still accepted as the model id, as vLLM serves it
    body = {"model": server.state.config.model.model, "prompt": "hi", "max_tokens": 1}
    assert http.post("/v1/completions", json=body).status_code == 200


def test_engine_counters_are_exported():
    from atomc.serve.metrics import ServerMetrics

    stats = {"num_preemptions": 3, "num_sampler_fallbacks": 2, "num_failed_steps": 1,
             "num_triton_compiles_while_serving": 4}  # fmt: skip
    text = ServerMetrics(lambda: stats, lambda: True).render()[0].decode()
    assert "atomc:num_preemptions_total 3.0" in text
    assert "atomc:sampler_fallbacks_total 2.0" in text
    assert "atomc:engine_failed_steps_total 1.0" in text
    assert "atomc:triton_compiles_while_serving_total 4.0" in text


def test_still_healthy_and_nothing_leaked(server, http, model):
    # runs after the bad inputs above: the server is up, serves, and holds no KV blocks
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    pool_is_free(server)


# ---------------------------------------------------------------- engine failure


class ExplodingEngine(EngineClient):
    """An EngineClient whose `step()` raises once two requests are in flight."""

    model_name, max_model_len, tokenizer, sampling_defaults = "fake", 64, None, {}

    def __init__(self):
        self.live: dict[str, int] = {}

    def add_request(self, request_id, prompt, params, arrival_time=None):
        if not prompt:
            raise ValueError("the prompt is empty")
        self.live[request_id] = 0

    def abort_request(self, request_id):
        self.live.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        if len(self.live) >= 2:
            raise RuntimeError("simulated device failure")
        time.sleep(0.005)
        outs = []
        for rid in self.live:
            self.live[rid] += 1
            k = self.live[rid]
            outs.append(RequestOutput(rid, "p", [1], [CompletionOutput(0, "x" * k, [7] * k)], False))
        return outs

    def stats(self):
        return {"num_running": len(self.live), "num_waiting": 0, "kv_cache_usage": 0.0}


def test_engine_failure_fails_requests_and_health():
    app = build_app(AsyncEngine(ExplodingEngine()), EngineConfig())
    with ServerThread(app, EngineConfig()) as st:
        client = openai.OpenAI(base_url=st.base_url + "/v1", api_key="x", max_retries=0, timeout=10)
        stream = client.completions.create(model="fake", prompt="a", max_tokens=50, stream=True)
        first = next(iter(stream))
        assert first.choices[0].text == "x"
        result = {}

        def blocking_call():  # the second request in flight makes the next step raise
            try:
                client.completions.create(model="fake", prompt="b", max_tokens=50)
            except openai.APIStatusError as e:
                result["status"] = e.status_code

        t = threading.Thread(target=blocking_call)
        t.start()
        with pytest.raises(openai.APIError, match="the engine failed") as e:
            for _ in stream:
                pass
        assert "simulated" not in str(e.value)  # the exception's text stays in the log
        t.join(10)
        assert result == {"status": 500}
        health = assert_error(httpx.get(st.base_url + "/health"), 503)
        assert "simulated" not in health["message"]
        late = httpx.post(st.base_url + "/v1/completions", json={"model": "fake", "prompt": "c"}, timeout=10)
        assert_error(late, 503)
        assert "engine_healthy 0.0" in httpx.get(st.base_url + "/metrics").text


class OneBadRequestEngine(EngineClient):
    """An EngineClient; the request with prompt "bad" ends as a failed step ends it (error set)."""

    model_name, max_model_len, tokenizer, sampling_defaults = "fake", 64, None, {}

    def __init__(self):
        self.live: dict[str, str] = {}

    def add_request(self, request_id, prompt, params, arrival_time=None):
        self.live[request_id] = prompt

    def abort_request(self, request_id):
        self.live.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        time.sleep(0.005)
        outs = []
        for rid, prompt in list(self.live.items()):
            out = RequestOutput(rid, prompt, [1], [CompletionOutput(0, "x", [7], "stop")], True)
            if prompt == "bad":
                out.outputs[0].finish_reason, out.error = "abort", "IndexError: internal detail"
            outs.append(out)
            del self.live[rid]
        return outs

    def stats(self):
        return {"num_running": len(self.live), "num_waiting": 0}


def test_a_failed_request_is_500_and_the_server_keeps_serving():
    app = build_app(AsyncEngine(OneBadRequestEngine()), EngineConfig())
    with ServerThread(app, EngineConfig()) as st:
        url = st.base_url + "/v1/completions"
        err = assert_error(httpx.post(url, json={"prompt": "bad"}, timeout=10), 500)
        assert err["code"] == "engine_failed" and "internal detail" not in err["message"]
        with httpx.stream("POST", url, json={"prompt": "bad", "stream": True}, timeout=10) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and '"engine_failed"' in lines[-2]
        # one prompt of several failing fails the whole HTTP request
        assert_error(httpx.post(url, json={"prompt": ["good", "bad"]}, timeout=10), 500)
        assert httpx.get(st.base_url + "/health").status_code == 200
        assert httpx.post(url, json={"prompt": "good"}, timeout=10).status_code == 200


DYING_SERVER = """
import sys
from atomc.config import EngineConfig
from atomc.serve.api import build_app
from atomc.serve.async_engine import AsyncEngine
from atomc.serve.server import _Serving, bind_socket, prepare_process, serve_app
from atomc.engine.client import EngineClient

class DyingEngine(EngineClient):
    model_name, max_model_len, tokenizer, sampling_defaults = "dying", 64, None, {}
    live = False
    def add_request(self, request_id, prompt, params, arrival_time=None):
        self.live = True
    def abort_request(self, request_id):
        pass
    def has_unfinished_requests(self):
        return self.live
    def step(self):
        raise RuntimeError("device lost")
    def stats(self):
        return {}

cfg = EngineConfig()
cfg.serve.port = int(sys.argv[1])
prepare_process(cfg)
serving = _Serving()
app = build_app(AsyncEngine(DyingEngine(), on_dead=serving.engine_dead), cfg)
sys.exit(serve_app(app, cfg, bind_socket("127.0.0.1", cfg.serve.port), serving))
"""


def test_server_exits_non_zero_when_the_engine_dies():
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-c", DYING_SERVER, str(port)]
    proc = subprocess.Popen(cmd, env=subprocess_env(), stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = httpx.post(base + "/v1/completions", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 500
        t0 = time.monotonic()
        assert proc.wait(timeout=10) == 1
        assert time.monotonic() - t0 < 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- process lifecycle

# A server process exactly like `atomc serve` minus the model load (seconds of imports on 2 cores):
# an engine that emits one token per 10 ms, so a stream is still running when SIGTERM arrives.
SERVER_SCRIPT = """
import sys, time
from atomc.config import EngineConfig
from atomc.engine.client import EngineClient
from atomc.outputs import CompletionOutput, RequestOutput
from atomc.serve.api import build_app
from atomc.serve.async_engine import AsyncEngine
from atomc.serve.server import prepare_process, serve_app
from atomc.engine.client import EngineClient

class SlowEngine(EngineClient):
    model_name, max_model_len, tokenizer, sampling_defaults = "slow", 1024, None, {}
    def __init__(self):
        self.live = {}
    def add_request(self, request_id, prompt, params, arrival_time=None):
        self.live[request_id] = [0, params.max_tokens]
    def abort_request(self, request_id):
        self.live.pop(request_id, None)
    def has_unfinished_requests(self):
        return bool(self.live)
    def step(self):
        time.sleep(0.01)
        outs = []
        for rid, st in list(self.live.items()):
            st[0] += 1
            done = st[0] >= st[1]
            c = CompletionOutput(0, "x" * st[0], [7] * st[0], "length" if done else None)
            outs.append(RequestOutput(rid, "p", [1], [c], done))
            if done:
                del self.live[rid]
        return outs
    def stats(self):
        return {"num_running": len(self.live), "num_waiting": 0}

cfg = EngineConfig()
cfg.serve.port, cfg.serve.drain_timeout_s = int(sys.argv[1]), float(sys.argv[2])
prepare_process(cfg)
serve_app(build_app(AsyncEngine(SlowEngine()), cfg), cfg)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def start_server_process(drain_timeout_s: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER_SCRIPT, str(port), str(drain_timeout_s)],
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.05)


def sigterm_mid_stream(proc: subprocess.Popen, base: str, max_tokens: int) -> list[str]:
    """Open a stream, SIGTERM the server after its first chunk, return the whole stream."""
    body = {"prompt": "Once", "max_tokens": max_tokens, "stream": True}
    rest = []
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
        lines = (line for line in r.iter_lines() if line)
        rest.append(next(lines))
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(httpx.TransportError):  # a cut stream may end abruptly
            rest.extend(lines)
    return rest


def test_sigterm_drains_in_flight_stream():
    proc, base = start_server_process(drain_timeout_s=20)
    try:
        rest = sigterm_mid_stream(proc, base, max_tokens=100)  # ~1 s of tokens
        assert rest[-1] == "data: [DONE]"
        assert '"finish_reason":"length"' in rest[-2]
        # all 100 tokens; a reader that falls behind gets several in one chunk, so count the text
        chunks = [json.loads(line.removeprefix("data: ")) for line in rest[:-1]]
        assert sum(len(c["choices"][0]["text"]) for c in chunks) == 100
        assert proc.wait(timeout=30) == 0
        with pytest.raises(httpx.TransportError):  # and it is really gone
            httpx.get(base + "/health", timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_drain_timeout_cuts_long_streams():
    proc, base = start_server_process(drain_timeout_s=0.5)
    try:
        t0 = time.monotonic()
        rest = sigterm_mid_stream(proc, base, max_tokens=1000)  # ~10 s of tokens: longer than the drain
        # cut cleanly: an SSE error event, then [DONE], not a broken chunked body
        assert rest[-1] == "data: [DONE]" and len(rest) < 500, rest[-3:]
        assert '"code":"server_shutting_down"' in rest[-2]
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - t0 < 8
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


LAUNCHER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=sys.stdout)
print(child.pid, flush=True)
time.sleep(60)
"""
GUARDED = (
    "import time; from atomc.serve.server import die_with_parent; print(die_with_parent(), flush=True); time.sleep(60)"
)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # a zombie waiting for its new parent to reap it is gone too


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_server_dies_with_its_parent():
    env = subprocess_env()
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, GUARDED], env=env, stdout=subprocess.PIPE, text=True)
    child = int(launcher.stdout.readline())
    try:
        assert launcher.stdout.readline().strip() == "True"  # armed
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while not _gone(child):
            assert time.monotonic() < deadline, "child outlived its parent"
            time.sleep(0.05)
    finally:
        if not _gone(child):
            os.kill(child, signal.SIGKILL)


STARTING_SERVER = """
import time
from atomc.config import EngineConfig
from atomc.serve.server import prepare_process

prepare_process(EngineConfig())
print("loading", flush=True)
time.sleep(60)  # the model load, during which nothing is served yet
"""


def test_sigterm_during_start_up_exits_non_zero():
    proc = subprocess.Popen(
        [sys.executable, "-c", STARTING_SERVER], env=subprocess_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "loading"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 128 + signal.SIGTERM  # not 0: it never served
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


STARTUP_PHASES = [
    r"start-up: listening on 127\.0\.0\.1:\d+; loading the model",
    r"start-up: HTTP side imported in \d+\.\ds",
    r"start-up: engine process spawned in \d+\.\ds, engine imports \d+\.\ds",
    r"start-up: model folder \d+\.\ds, tokenizer \d+\.\ds \(llama\)",
    r"start-up: imports \d+\.\ds \(backend ops, compiler\), weights \d+\.\ds, model \(eager\) \d+\.\ds, "
    r"KV sizing \d+\.\ds .*"
    r"KV cache \(64 blocks\): \d+\.\ds in all",
    r"start-up: engine ready in \d+\.\ds",
    r"start-up: server-side tokenizer \d+\.\ds, overlapped with the engine's start",
    r"start-up: engine \d+\.\ds, HTTP app \d+\.\ds",
    r"serving llama \(max_model_len 512\) on http://127\.0\.0\.1:\d+; loaded in \d+\.\ds",
]


def _children(pid: int) -> set[int]:
    kids = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            kids.update(int(k) for k in (task / "children").read_text().split())
    return kids


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads children from /proc")
def test_start_up_logs_each_phase_and_a_second_ctrl_c_exits_non_zero_at_once(llama_dir):
    # the real `atomc serve`, with its engine in a spawned process: the second Ctrl-C must not wait for
    # the drain (30 s here) nor leave that process behind
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "atomc.cli.main", "serve", "--model", str(llama_dir), "--device", "cpu"]
    cmd += ["--enforce-eager", "--engine-process", "on", "--max-model-len", "512", "--num-kv-blocks", "64"]
    cmd += ["--port", str(port), "--drain-timeout", "30"]
    proc = subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    kids: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.1)
        kids = _children(proc.pid)
        assert kids, "no engine process"
        body = {"model": llama_dir.name, "prompt": "Once", "max_tokens": 500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
            lines = (line for line in r.iter_lines() if line)
            next(lines)
            proc.send_signal(signal.SIGINT)  # drain: the stream may run on for up to 30 s
            time.sleep(0.5)
            assert proc.poll() is None  # still draining
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(httpx.TransportError):
                for _ in lines:
                    pass
            assert proc.wait(timeout=10) == 128 + signal.SIGINT
            assert time.monotonic() - t0 < 8
        # and the start-up log named every phase of it, each with its time (where a slow start goes)
        log = proc.stderr.read().decode()
        for phase in STARTUP_PHASES:
            assert re.search(phase, log), (phase, log[-3000:])
        deadline = time.monotonic() + 5
        while not all(_gone(k) for k in kids):
            assert time.monotonic() < deadline, "the engine process outlived the server"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for k in kids:
            if not _gone(k):
                os.kill(k, signal.SIGKILL)
