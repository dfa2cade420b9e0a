"""Tool calls and reasoning output through a real server on loopback and the official openai SDK.

The engine is scripted (`ScriptedEngine`): it renders the chat template for real (the tokenizer of
the tiny llama checkpoint, with this file's template, which writes tools, tool calls and tool
results as Hermes/Qwen templates do) and answers with the reply a test sets, a few characters
per step, so each test controls exactly what the model "said" and sees exactly what was rendered.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from atomc.config import EngineConfig
from atomc.engine.client import EngineClient
from atomc.engine.inputs import InputProcessor
from atomc.engine.tokenizer import load_tokenizer
from atomc.outputs import CompletionOutput, RequestOutput
from atomc.serve import chat_request
from atomc.serve.api import build_app
from atomc.serve.async_engine import AsyncEngine
from atomc.serve.server import ServerThread, check_output_parsers

TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response id="{{ m.tool_call_id }}">{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}},
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
USER = [{"role": "user", "content": "Weather in Paris and the time there?"}]


def hermes(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


class ScriptedEngine(EngineClient):
    """An EngineClient that renders prompts for real and replies with `self.reply`, 3 characters a step."""

    model_name, max_model_len, sampling_defaults = "scripted", 4096, {}
    STEP = 3

    def __init__(self, model_dir, template: str):
        self.tokenizer = load_tokenizer(model_dir)
        self.inputs = InputProcessor(self.tokenizer, 10**6, self.max_model_len, template)
        self.eos_id = self.tokenizer.eos_token_id
        self.reply = ""
        self.prompts: list[str] = []
        self.params: list = []
        self.live: dict[str, list] = {}
        self.lock = threading.Lock()

    def add_request(self, request_id, prompt, params, arrival_time=None, add_special_tokens=True):
        with self.lock:
            self.prompts.append(prompt)
            self.params.append(params)
            self.live[request_id] = [prompt, params, 0]

    def abort_request(self, request_id):
        with self.lock:
            self.live.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        time.sleep(0.002)
        outs = []
        with self.lock:
            for rid, state in list(self.live.items()):
                prompt, params, sent = state
                sent = state[2] = min(len(self.reply), sent + self.STEP)
                done = sent == len(self.reply)
                text, ids = self.reply[:sent], [5] * sent
                if done:  # the EOS token ends it; its text shows only when special tokens are decoded
                    ids = ids + [self.eos_id]
                    if not params.skip_special_tokens:
                        text += self.tokenizer.decode([self.eos_id])
                    del self.live[rid]
                choices = [CompletionOutput(i, text, list(ids), "stop" if done else None) for i in range(params.n)]
                outs.append(RequestOutput(rid, prompt, [1, 2], choices, done))
        return outs

    def stats(self):
        return {"num_running": len(self.live), "num_waiting": 0}


def start(llama_dir, **serve):
    engine = ScriptedEngine(llama_dir, TEMPLATE)
    cfg = EngineConfig()
    for k, v in serve.items():
        setattr(cfg.serve, k, v)
    st = ServerThread(build_app(AsyncEngine(engine), cfg), cfg).start()
    st.engine = engine
    st.client = openai.OpenAI(base_url=st.base_url + "/v1", api_key="x", max_retries=0, timeout=30)
    return st


@pytest.fixture(scope="module")
def server(llama_dir):
    st = start(llama_dir, enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield st
    st.stop()


@pytest.fixture(scope="module")
def thinking_server(llama_dir):
    st = start(llama_dir, enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
    yield st
    st.stop()


def chat(st, reply: str, **kw):
    st.engine.reply = reply
    kw.setdefault("messages", USER)
    return st.client.chat.completions.create(model="scripted", **kw)


def collect(stream) -> dict:
    """A streamed response added up as a client does."""
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None, "roles": []}
    for chunk in stream:
        (choice,) = chunk.choices
        d = choice.delta
        if d.role:
            out["roles"].append(d.role)
        out["content"] += d.content or ""
        out["reasoning"] += (d.model_extra or {}).get("reasoning_content") or ""
        for tc in d.tool_calls or []:
            call = out["calls"].setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert call["id"] is None and tc.type == "function"
                call["id"], call["name"] = tc.id, tc.function.name
            call["arguments"] += tc.function.arguments or ""
        out["finish"] = choice.finish_reason or out["finish"]
    return out


# ---------------------------------------------------------------- auto


def test_auto_tool_call(server):
    r = chat(server, hermes("get_weather", {"city": "Paris"}), tools=TOOLS)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # the tools reached the template, and a format with special-token markers reads them decoded
    assert '"name": "get_weather"' in server.engine.prompts[-1] and "The weather in a city" in server.engine.prompts[-1]
    assert server.engine.params[-1].skip_special_tokens is False


def test_auto_streamed_parallel_calls(server):
    reply = "Checking both.\n" + hermes("get_weather", {"city": "Paris"}) + "\n" + hermes("get_time", {"tz": "CET"})
    out = collect(chat(server, reply, tools=TOOLS, stream=True))
    assert out["roles"] == ["assistant"] and out["content"] == "Checking both."
    assert out["finish"] == "tool_calls"
    calls = [out["calls"][i] for i in sorted(out["calls"])]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"tz": "CET"}),
    ]
    assert len({c["id"] for c in calls}) == 2


def test_parallel_tool_calls_false_keeps_the_first_call(server):
    reply = hermes("get_weather", {"city": "Paris"}) + "\n" + hermes("get_time", {"tz": "CET"})
    r = chat(server, reply, tools=TOOLS, parallel_tool_calls=False)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    out = collect(chat(server, reply, tools=TOOLS, parallel_tool_calls=False, stream=True))
    assert [c["name"] for c in out["calls"].values()] == ["get_weather"]
    r = chat(server, reply, tools=TOOLS)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather", "get_time"]


def test_plain_reply_and_malformed_call_are_content(server):
    r = chat(server, "It is sunny in Paris.", tools=TOOLS)
    assert r.choices[0].message.content == "It is sunny in Paris." and r.choices[0].finish_reason == "stop"
    assert not r.choices[0].message.tool_calls
    bad = "<tool_call>\n{name: get_weather}\n</tool_call>"
    r = chat(server, bad, tools=TOOLS)
    assert r.choices[0].message.content == bad and not r.choices[0].message.tool_calls
    out = collect(chat(server, bad, tools=TOOLS, stream=True))
    assert out["content"] == bad and not out["calls"] and out["finish"] == "stop"


def test_tool_choice_none_does_not_parse(server):
    reply = hermes("get_weather", {"city": "Paris"})
    r = chat(server, reply, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == reply and not r.choices[0].message.tool_calls
    assert "get_weather" in server.engine.prompts[-1]  # the tools are still rendered, as vLLM does


def test_history_with_tool_calls_and_results_is_rendered(server):
    history = USER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    r = chat(server, "It is 18 C and sunny.", tools=TOOLS, messages=history)
    assert r.choices[0].message.content == "It is 18 C and sunny."
    prompt = server.engine.prompts[-1]
    # the arguments reach the template as a mapping (rendered once as JSON, not as a quoted string)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<tool_response id="call_1">18 C, sunny</tool_response>' in prompt


# ---------------------------------------------------------------- required / named (constrained)


@pytest.fixture
def constrained(monkeypatch):
    """As if the grammar engine were there: the request path builds the constraint either way."""
    monkeypatch.setattr(chat_request, "constrained_decoding_available", lambda: True)


def test_named_function_is_constrained_and_read_from_the_json(server, constrained):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(server, '{"city": "Paris"}', tools=TOOLS, tool_choice=choice)
    so = server.engine.params[-1].structured_outputs
    assert so is not None and so.json == WEATHER_TOOL["function"]["parameters"]
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert r.choices[0].finish_reason == "stop"  # as OpenAI answers a forced function
    out = collect(chat(server, '{"city": "Paris"}', tools=TOOLS, tool_choice=choice, stream=True))
    assert out["calls"][0]["name"] == "get_weather" and json.loads(out["calls"][0]["arguments"]) == {"city": "Paris"}


def test_required_is_constrained_and_read_from_the_json(server, constrained):
    reply = json.dumps(
        [{"name": "get_time", "parameters": {"tz": "CET"}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]
    )
    r = chat(server, reply, tools=TOOLS, tool_choice="required")
    schema = server.engine.params[-1].structured_outputs.json
    assert schema["type"] == "array" and schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    assert [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls] == [
        ("get_time", {"tz": "CET"}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert r.choices[0].finish_reason == "tool_calls"
    chat(server, reply, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert server.engine.params[-1].structured_outputs.json["maxItems"] == 1
    out = collect(chat(server, reply, tools=TOOLS, tool_choice="required", stream=True))
    assert [out["calls"][i]["name"] for i in sorted(out["calls"])] == ["get_time", "get_weather"]


def test_unparseable_constrained_output_falls_back_to_content(server, constrained):
    r = chat(server, "not json", tools=TOOLS, tool_choice="required")
    assert r.choices[0].message.content == "not json" and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_required_without_the_grammar_engine_is_a_clear_400(server, monkeypatch):
    monkeypatch.setattr(chat_request, "constrained_decoding_available", lambda: False)
    with pytest.raises(openai.BadRequestError, match="constrained decoding"):
        chat(server, "[]", tools=TOOLS, tool_choice="required")


# ---------------------------------------------------------------- refusals


def test_auto_needs_the_flags(llama_dir):
    st = start(llama_dir)
    try:
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
            chat(st, "x", tools=TOOLS)
        r = chat(st, "plain", tools=TOOLS, tool_choice="none")  # none needs no parser
        assert r.choices[0].message.content == "plain"
    finally:
        st.stop()


@pytest.mark.parametrize(
    "body, message",
    [
        ({"tool_choice": "required"}, "only allowed when tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "is not one of"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs may not set tools"),
        ({"messages": [{"role": "tool", "content": "18 C"}]}, "tool_call_id"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name"),
    ],
)
def test_bad_tool_requests_are_400(server, body, message):
    payload = {"model": "scripted", "messages": USER, **body}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=payload, timeout=10)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_start_up_checks_parser_names():
    cfg = EngineConfig().serve
    cfg.enable_auto_tool_choice = True
    with pytest.raises(ValueError, match="--tool-call-parser"):
        check_output_parsers(cfg)
    cfg.tool_call_parser = "hermes2"
    with pytest.raises(ValueError, match="not one of"):
        check_output_parsers(cfg)
    cfg.tool_call_parser, cfg.reasoning_parser = "hermes", "r1"
    with pytest.raises(ValueError, match="deepseek_r1"):
        check_output_parsers(cfg)


# ---------------------------------------------------------------- the APIs translated into chat


def test_responses_api_function_calls(server):
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_TOOL["function"]["parameters"]}
    server.engine.reply = hermes("get_weather", {"city": "Paris"})
    r = server.client.responses.create(model="scripted", input="Weather in Paris?", tools=[tool])
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    events = list(server.client.responses.create(model="scripted", input="Weather?", tools=[tool], stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}


def test_anthropic_messages_tool_use(server):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0, timeout=30)
    tool = {"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}
    server.engine.reply = "Checking.\n" + hermes("get_weather", {"city": "Paris"})
    msg = client.messages.create(
        model="scripted", max_tokens=64, tools=[tool], messages=[{"role": "user", "content": "Weather in Paris?"}]
    )
    assert msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["text", "tool_use"] and msg.content[0].text == "Checking."
    assert msg.content[1].name == "get_weather" and msg.content[1].input == {"city": "Paris"}


# ---------------------------------------------------------------- reasoning


def test_reasoning_split(thinking_server):
    reply = "<think>\nParis is in CET.\n</think>\n\nIt is noon in Paris."
    r = chat(thinking_server, reply)
    msg = r.choices[0].message
    assert msg.content == "It is noon in Paris."
    assert msg.model_extra["reasoning_content"] == msg.model_extra["reasoning"] == "Paris is in CET.\n"
    out = collect(chat(thinking_server, reply, stream=True))
    assert out["reasoning"] == "Paris is in CET.\n" and out["content"] == "It is noon in Paris."


def test_reasoning_then_tool_call_streamed(thinking_server):
    reply = "<think>Need the weather.</think>\n" + hermes("get_weather", {"city": "Paris"})
    out = collect(chat(thinking_server, reply, tools=TOOLS, stream=True))
    assert out["reasoning"] == "Need the weather." and out["content"] == ""
    assert out["calls"][0]["name"] == "get_weather" and out["finish"] == "tool_calls"


def test_chat_template_kwargs_reach_the_template(thinking_server):
    r = chat(thinking_server, "Noon.", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert thinking_server.engine.prompts[-1].endswith("<think>\n\n</think>\n\n")
    assert r.choices[0].message.content == "Noon." and r.choices[0].message.model_extra["reasoning_content"] is None


def test_harmony_parsers_fail_at_start_up_when_their_encoding_cannot_load(tmp_path, monkeypatch):
    from atomc.serve.harmony_stream import harmony_encoding

    # an empty vocabulary folder: the package reads only there (no download is tried)
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path))
    harmony_encoding.cache_clear()
    cfg = EngineConfig().serve
    cfg.reasoning_parser = "openai"
    with pytest.raises(RuntimeError, match="TIKTOKEN_ENCODINGS_BASE"):
        check_output_parsers(cfg)
