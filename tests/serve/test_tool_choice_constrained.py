"""`tool_choice: "required"` and a named function on a tiny random-weight model: only the
constraint (SamplingParams.structured_outputs, enforced by atomc.engine.structured_outputs) can
make its output well-formed calls, so valid calls here show the constraint is applied end to end."""

from __future__ import annotations

import importlib.util
import json

import openai
import pytest

from atomc.config import EngineConfig
from atomc.serve.server import ServerThread, build_server_app

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("atomc.engine.structured_outputs") is None,
    reason="atomc.engine.structured_outputs (the grammar engine that enforces the constraint) is not in this tree",
)

jsonschema = pytest.importorskip("jsonschema")

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TZ = {
    "type": "object",
    "properties": {"tz": {"enum": ["CET", "UTC"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "get_time", "parameters": TZ}},
]
SCHEMAS = {"get_weather": CITY, "get_time": TZ}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def client(llama_dir):
    cfg = EngineConfig(device="cpu")
    cfg.model.model = str(llama_dir)
    cfg.model.max_model_len = 512
    cfg.compile.enforce_eager = True
    cfg.cache.num_kv_blocks = 128
    cfg.serve.engine_process = "off"
    app = build_server_app(cfg)
    with ServerThread(app, cfg) as st:
        yield openai.OpenAI(base_url=st.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


def check(calls):
    assert calls, "no tool call"
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_named_function_gives_valid_arguments(client, seed):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
        max_tokens=200, temperature=1.0, seed=seed,
    )  # fmt: skip
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    check([call])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_gives_valid_calls(client, seed):
    r = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        max_tokens=300, temperature=1.0, seed=seed,
    )  # fmt: skip
    check(r.choices[0].message.tool_calls)
    # a random model may keep adding calls until max_tokens: the complete ones come back, "length"
    cut = r.usage.completion_tokens == 300
    assert r.choices[0].finish_reason == ("length" if cut else "tool_calls")


def test_required_streamed_calls_are_valid(client):
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        max_tokens=300, temperature=1.0, seed=3, stream=True,
    )  # fmt: skip
    calls: dict[int, dict] = {}
    for chunk in stream:
        deltas = chunk.choices[0].delta.tool_calls if chunk.choices else None
        for tc in deltas or []:
            c = calls.setdefault(tc.index, {"name": None, "arguments": ""})
            c["name"] = c["name"] or tc.function.name
            c["arguments"] += tc.function.arguments or ""
    assert calls
    for c in calls.values():
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])
