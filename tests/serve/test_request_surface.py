"""The request surface beyond the basics, end to end: the official openai SDK (extra fields through
`extra_body`) against a real server on loopback with a tiny random llama, through the engine process.

Sampling fields: logit_bias, allowed_token_ids, bad_words, best_of, prompt_logprobs, min_tokens, stop
with include_stop_str_in_output, truncate_prompt_tokens. Endpoints: models.retrieve, /tokenize,
/detokenize, /health's body, and the access-log filter (the server logs at info for that test).
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import time

import httpx
import openai
import pytest

from atomc.config import EngineConfig
from atomc.serve.access_log import AccessLogFilter
from atomc.serve.server import ServerThread, build_server_app

MAX_MODEL_LEN = 128
PROMPT = "The capital of France"


@pytest.fixture(scope="module")
def server(llama_dir):
    cfg = EngineConfig(device="cpu")
    cfg.model.model = str(llama_dir)
    cfg.model.max_model_len = MAX_MODEL_LEN
    cfg.compile.enforce_eager = True
    cfg.cache.num_kv_blocks = 256
    cfg.serve.engine_process = "on"  # the front end tokenizes bad words and checks ids; params cross the pipe
    cfg.serve.disable_access_log_for_endpoints = ["/health"]
    app = build_server_app(cfg)
    with ServerThread(app, cfg, log_level="info") as st:
        st.state = app.state.atomc
        yield st


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def root(server) -> openai.OpenAI:
    """The SDK pointed at the server's root, for vLLM's /tokenize and /detokenize."""
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(server) -> str:
    return server.state.model_name


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(llama_dir)


def complete(client, model, prompt=PROMPT, max_tokens=8, **kw):
    kw.setdefault("temperature", 0)
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, **kw)


def token_ids(choice, tokenizer) -> list[int]:
    """A completion choice's token ids, from its logprobs' token strings (logprobs=0 requested)."""
    return [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(t))[0] for t in choice.logprobs.tokens]


def status(client_call) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as e:
        client_call()
    return e.value


def bad_param(client_call, param: str) -> dict:
    err = status(client_call)
    assert err.status_code == 400, err
    assert err.body["param"] == param, err.body
    return err.body


# ---------------------------------------------------------------- logit_bias


def test_logit_bias_forces_and_bans_tokens(client, model, tokenizer):
    base = complete(client, model, extra_body={"ignore_eos": True})
    forced_id = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(" Paris"))[0]
    forced = complete(client, model, logit_bias={str(forced_id): 100}, logprobs=0, extra_body={"ignore_eos": True})
    assert token_ids(forced.choices[0], tokenizer) == [forced_id] * 8
    first = tokenizer(base.choices[0].text, add_special_tokens=False)["input_ids"][0]
    banned = complete(client, model, logit_bias={str(first): -100}, extra_body={"ignore_eos": True})
    assert tokenizer(banned.choices[0].text, add_special_tokens=False)["input_ids"][0] != first
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logit_bias={str(forced_id): 100},
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    assert [t.token for t in chat.choices[0].logprobs.content] == [tokenizer.decode([forced_id])] * 4


def test_logit_bias_is_clamped_and_its_ids_checked(client, model, server):
    vocab = server.state.engine.inputs.vocab_size
    # a bias past 100 is clamped as vLLM does (the request is fine)
    assert complete(client, model, logit_bias={"5": 1e6}).choices
    body = bad_param(lambda: complete(client, model, logit_bias={str(vocab): 5}), "logit_bias")
    assert "vocabulary" in body["message"]
    bad_param(lambda: complete(client, model, logit_bias={"five": 5}), "logit_bias")
    bad_param(lambda: complete(client, model, logit_bias={"-3": 5}), "logit_bias")


# ---------------------------------------------------------------- allowed_token_ids, bad_words


def test_allowed_token_ids_bound_every_sampled_token(client, model, tokenizer, server):
    allowed = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(" the cat sat"))
    r = complete(
        client, model, temperature=1.0, seed=7, n=3, logprobs=0,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
    )  # fmt: skip
    for c in r.choices:
        assert set(token_ids(c, tokenizer)) <= set(allowed)
    vocab = server.state.engine.inputs.vocab_size
    bad_param(lambda: complete(client, model, extra_body={"allowed_token_ids": []}), "allowed_token_ids")
    bad_param(lambda: complete(client, model, extra_body={"allowed_token_ids": [1, vocab]}), "allowed_token_ids")


def two_token_word(root, model) -> tuple[str, list[int]]:
    for word in ("capital", "France", "Paris", "function", "return", "upon", "time"):
        ids = root.post("/tokenize", body={"model": model, "prompt": word, "add_special_tokens": False}, cast_to=object)
        if len(set(ids["tokens"])) == 2 and len(ids["tokens"]) == 2:
            return word, ids["tokens"]
    raise AssertionError("no two-token word in the test vocabulary")


def test_bad_words_ban_a_word_once_its_prefix_is_generated(client, root, model, tokenizer):
    word, (a, b) = two_token_word(root, model)
    kw = dict(temperature=1.0, seed=11, max_tokens=24, logprobs=0)
    body = {"allowed_token_ids": [a, b], "ignore_eos": True}
    free = token_ids(complete(client, model, extra_body=body, **kw).choices[0], tokenizer)
    assert (a, b) in set(itertools.pairwise(free))  # without bad_words the pair comes up (seeded)
    banned = token_ids(complete(client, model, extra_body={**body, "bad_words": [word]}, **kw).choices[0], tokenizer)
    assert (a, b) not in set(itertools.pairwise(banned))
    assert len(banned) == 24
    bad_param(lambda: complete(client, model, extra_body={"bad_words": [""]}), "bad_words")
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=24, temperature=1.0, seed=11,
        logprobs=True, extra_body={**body, "bad_words": [word]},
    )  # fmt: skip
    ids = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(t.token))[0] for t in chat.choices[0].logprobs.content]
    assert (a, b) not in set(itertools.pairwise(ids))


# ---------------------------------------------------------------- best_of


def test_best_of_returns_the_samples_of_highest_cumulative_logprob(client, model):
    kw = dict(temperature=1.0, seed=1234, max_tokens=6, logprobs=0, extra_body={"ignore_eos": True})
    every = complete(client, model, n=4, **kw)  # sample i draws from seed + i, with or without best_of
    scores = [sum(c.logprobs.token_logprobs) for c in every.choices]
    order = sorted(range(4), key=lambda i: -scores[i])
    one = complete(client, model, n=1, best_of=4, **kw)
    assert [c.text for c in one.choices] == [every.choices[order[0]].text]
    two = complete(client, model, n=2, best_of=4, **kw)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.text for c in two.choices] == [every.choices[i].text for i in order[:2]]
    assert two.usage.completion_tokens == every.usage.completion_tokens  # every sample ran
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=1.0, seed=5, n=1,
        extra_body={"best_of": 3},
    )  # fmt: skip
    assert len(chat.choices) == 1


def test_best_of_validation(client, model):
    bad_param(lambda: complete(client, model, n=3, best_of=2), "best_of")
    bad_param(lambda: complete(client, model, best_of=0), "best_of")
    bad_param(lambda: complete(client, model, n=1, best_of=2, stream=True), "best_of")
    chunks = list(complete(client, model, n=2, best_of=2, temperature=1.0, stream=True))  # best_of == n streams
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}


# ---------------------------------------------------------------- prompt_logprobs


def test_prompt_logprobs_match_a_log_softmax_of_the_prompt(client, model, llama_dir, tokenizer):
    import torch
    import transformers

    r = complete(client, model, max_tokens=1, extra_body={"prompt_logprobs": 2})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    ids = tokenizer(PROMPT)["input_ids"]
    assert len(plp) == len(ids) == r.usage.prompt_tokens and plp[0] is None
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1)
    for p in range(1, len(ids)):
        entry = plp[p]
        assert str(ids[p]) in entry and 2 <= len(entry) <= 3
        assert entry[str(ids[p])]["logprob"] == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)
        top = ref[p - 1].topk(2)
        for rank, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist(), strict=True), start=1):
            assert entry[str(t)]["logprob"] == pytest.approx(v, abs=1e-4)
            assert entry[str(t)]["rank"] == rank
            assert entry[str(t)]["decoded_token"] == tokenizer.decode([t])
    # chat: once per response, as vLLM puts it
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    chat_plp = chat.model_extra["prompt_logprobs"]
    assert len(chat_plp) == chat.usage.prompt_tokens and chat_plp[0] is None
    assert all(len(e) == 1 for e in chat_plp[1:])


def test_prompt_logprobs_cannot_stream(client, model):
    bad_param(lambda: complete(client, model, stream=True, extra_body={"prompt_logprobs": 1}), "prompt_logprobs")
    bad_param(lambda: complete(client, model, extra_body={"prompt_logprobs": 21}), "prompt_logprobs")


# ---------------------------------------------------------------- min_tokens, stop


def test_min_tokens_delays_eos(client, model, tokenizer):
    eos = {str(tokenizer.eos_token_id): 100}  # the model would stop at once
    assert complete(client, model, logit_bias=eos).usage.completion_tokens == 1
    r = complete(client, model, logit_bias=eos, extra_body={"min_tokens": 5})
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 6  # five tokens, then the eos that ends it
    bad_param(lambda: complete(client, model, max_tokens=4, extra_body={"min_tokens": 5}), "min_tokens")


def stream_text(stream) -> tuple[str, str | None, object]:
    text, finish, stop_reason = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
            stop_reason = chunk.choices[0].model_extra.get("stop_reason") or stop_reason
    return text, finish, stop_reason


@pytest.mark.parametrize("include", [False, True])
def test_stop_with_and_without_the_stop_string(client, model, include):
    base = complete(client, model, max_tokens=16, extra_body={"ignore_eos": True}).choices[0].text
    stop = base[4:7]
    assert len(stop) == 3 and base.find(stop) >= 0
    cut = base.find(stop) + (len(stop) if include else 0)
    kw = dict(max_tokens=16, stop=[stop], extra_body={"ignore_eos": True, "include_stop_str_in_output": include})
    r = complete(client, model, **kw).choices[0]
    assert (r.text, r.finish_reason, r.model_extra["stop_reason"]) == (base[:cut], "stop", stop)
    assert stream_text(complete(client, model, stream=True, **kw)) == (base[:cut], "stop", stop)
    chat_kw = dict(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=16, temperature=0)
    chat_base = client.chat.completions.create(**chat_kw, extra_body={"ignore_eos": True}).choices[0].message.content
    chat_stop = chat_base[4:7]
    chat_cut = chat_base.find(chat_stop) + (len(chat_stop) if include else 0)
    chat_body = {"ignore_eos": True, "include_stop_str_in_output": include}
    c = client.chat.completions.create(**chat_kw, stop=chat_stop, extra_body=chat_body).choices[0]
    assert c.message.content == chat_base[:chat_cut]
    streamed = "".join(
        ch.choices[0].delta.content or ""
        for ch in client.chat.completions.create(**chat_kw, stop=chat_stop, stream=True, extra_body=chat_body)
        if ch.choices
    )
    assert streamed == chat_base[:chat_cut]


# ---------------------------------------------------------------- truncate_prompt_tokens


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, model, tokenizer):
    long = "Once upon a time, in a land far away, there lived a king who loved the sea"
    ids = tokenizer(long)["input_ids"]
    r = complete(client, model, prompt=long, extra_body={"truncate_prompt_tokens": 5, "ignore_eos": True})
    assert r.usage.prompt_tokens == 5
    same = complete(client, model, prompt=ids[-5:], extra_body={"ignore_eos": True})
    assert r.choices[0].text == same.choices[0].text
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": long}], max_tokens=2,
        extra_body={"truncate_prompt_tokens": 7},
    )  # fmt: skip
    assert chat.usage.prompt_tokens == 7
    bad_param(lambda: complete(client, model, extra_body={"truncate_prompt_tokens": 0}), "truncate_prompt_tokens")
    big = MAX_MODEL_LEN + 1
    bad_param(lambda: complete(client, model, extra_body={"truncate_prompt_tokens": big}), "truncate_prompt_tokens")


# ---------------------------------------------------------------- endpoints


def test_models_retrieve(client, model, server):
    card = client.models.retrieve(model)
    assert card.id == model and card.object == "model"
    assert card.model_extra["max_model_len"] == MAX_MODEL_LEN
    err = status(lambda: client.models.retrieve("no-such-model"))
    assert isinstance(err, openai.NotFoundError)
    assert err.body == {
        "message": "The model `no-such-model` does not exist.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert httpx.get(server.base_url + "/v1/models/a/b").status_code == 404  # ids with a slash reach the route


def test_tokenize_a_prompt(root, model, tokenizer, server):
    r = root.post("/tokenize", body={"model": model, "prompt": PROMPT}, cast_to=object)
    assert r == {"count": len(r["tokens"]), "max_model_len": MAX_MODEL_LEN, "tokens": tokenizer(PROMPT)["input_ids"]}
    plain = root.post("/tokenize", body={"prompt": PROMPT, "add_special_tokens": False}, cast_to=object)
    assert plain["tokens"] == tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    strs = root.post("/tokenize", body={"prompt": PROMPT, "return_token_strs": True}, cast_to=object)
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(r["tokens"])
    err = status(lambda: root.post("/tokenize", body={"model": "nope", "prompt": "x"}, cast_to=object))
    assert err.status_code == 404


def test_tokenize_messages_as_chat_renders_them(root, client, model, tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = root.post("/tokenize", body={"model": model, "messages": messages}, cast_to=object)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert r["tokens"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    assert r["count"] == chat.usage.prompt_tokens  # what the chat route feeds the model
    no_gen = root.post("/tokenize", body={"messages": messages, "add_generation_prompt": False}, cast_to=object)
    assert no_gen["count"] < r["count"]
    body = {"messages": messages, "continue_final_message": True}  # add_generation_prompt defaults to true
    assert status(lambda: root.post("/tokenize", body=body, cast_to=object)).status_code == 400


def test_detokenize(root, model, tokenizer, server):
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert root.post("/detokenize", body={"model": model, "tokens": ids}, cast_to=object) == {"prompt": PROMPT}
    vocab = server.state.engine.inputs.vocab_size
    err = status(lambda: root.post("/detokenize", body={"tokens": [1, vocab]}, cast_to=object))
    assert err.status_code == 400 and err.body["param"] == "tokens"


def test_health_answers_json(server):
    r = httpx.get(server.base_url + "/health")
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {"status": "ok"}


def test_access_log_skips_the_excluded_paths(server):
    """The server logs at info with /health excluded: uvicorn's access handler (the one uvicorn set up
    from atomc's log config) writes the /version line and drops the /health one."""
    (handler,) = [h for h in logging.getLogger("uvicorn.access").handlers if h.filters]
    assert any(isinstance(f, AccessLogFilter) for f in handler.filters)
    out = io.StringIO()
    old = handler.setStream(out)
    try:
        httpx.get(server.base_url + "/health")
        httpx.get(server.base_url + "/version")
        deadline = time.monotonic() + 5
        while "/version" not in out.getvalue():  # written once the response is out
            assert time.monotonic() < deadline, out.getvalue()
            time.sleep(0.01)
    finally:
        handler.setStream(old)
    assert "GET /health" not in out.getvalue()


def test_openapi_declares_the_new_routes(server):
    doc = httpx.get(server.base_url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for name in ("TokenizeCompletionRequest", "TokenizeChatRequest", "DetokenizeRequest"):
        assert name in schemas
    tok = doc["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {r["$ref"] for r in tok["oneOf"]} == {
        "#/components/schemas/TokenizeCompletionRequest",
        "#/components/schemas/TokenizeChatRequest",
    }
    assert "/v1/models/{model_id}" in doc["paths"]
    fields = set(schemas["CompletionRequest"]["properties"])
    assert {"logit_bias", "allowed_token_ids", "bad_words", "best_of", "prompt_logprobs"} <= fields
    assert "truncate_prompt_tokens" in schemas["ChatCompletionRequest"]["properties"]
    json.dumps(doc)  # the document serializes
