"""Tool-call and reasoning parsers on the formats' published examples: the whole-output parse,
the streamed deltas (fed one character at a time, and in uneven pieces) adding up to the same
calls, and malformed output falling back to plain content."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from atomc.serve.chat_output import ChatOutputSetup, ChoiceParser
from atomc.serve.reasoning_parsers import REASONING_PARSERS, reasoning_parser_class
from atomc.serve.tool_parsers import TOOL_PARSERS, tool_parser_class
from atomc.serve.tool_parsers.constrained import NamedFunctionParser, RequiredCallsParser, required_schema
from atomc.serve.tool_parsers.deepseek_v3 import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP
from atomc.serve.tool_parsers.json_scan import hold_back, scan_object, value_end

WEATHER = {"location": "San Francisco, CA", "unit": "celsius"}
TIME = {"timezone": "Europe/Paris"}


def stream(parser: ChoiceParser, text: str, pieces: list[int] | None = None) -> dict:
    """Feed `text` cumulatively (cut at `pieces`, else one character at a time) and add the
    deltas up as a client does: content and reasoning concatenated, tool calls by index."""
    cuts = pieces if pieces is not None else list(range(1, len(text)))
    cuts = [c for c in cuts if 0 < c < len(text)] + [len(text)]
    out: dict = {"content": "", "reasoning": "", "calls": {}}
    for n, end in enumerate(cuts):
        d = parser.delta(text[:end], [], final=n == len(cuts) - 1)
        out["content"] += d.get("content", "")
        out["reasoning"] += d.get("reasoning_content", "")
        assert d.get("reasoning") == d.get("reasoning_content")
        for tc in d.get("tool_calls", []):
            call = out["calls"].setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                assert call["id"] is None, "a call's id and name come once, first"
                assert tc["type"] == "function" and tc["function"]["name"]
                call["id"], call["name"] = tc["id"], tc["function"]["name"]
            assert call["name"] is not None, "arguments came before the call's name"
            call["arguments"] += tc["function"].get("arguments", "")
    return out


def parser_for(name: str, tools=None) -> ChoiceParser:
    return ChoiceParser(None, tool_parser_class(name)(tools), reports_reasoning=False)


def check_format(name: str, text: str, content: str | None, calls: list[tuple[str, dict]]):
    """Non-streaming and streamed parses of `text` agree with the expected content and calls."""
    msg = parser_for(name).message(text, [])
    assert msg["content"] == content
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])]
    assert got == calls
    ids = [c["id"] for c in msg.get("tool_calls", [])]
    assert len(set(ids)) == len(ids)
    for pieces in (None, list(range(0, len(text), 7)), [len(text) // 2]):
        s = stream(parser_for(name), text, pieces)
        assert s["content"] == (content or "")
        streamed = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(s["calls"].items())]
        assert streamed == calls


# ---------------------------------------------------------------- hermes (Hermes 2 Pro, Qwen 2.5 / 3)


def test_hermes_one_call():
    text = '<tool_call>\n{"name": "get_current_weather", "arguments": ' + json.dumps(WEATHER) + "}\n</tool_call>"
    check_format("hermes", text, None, [("get_current_weather", WEATHER)])


def test_hermes_content_then_parallel_calls():
    text = (
        "Let me check both.\n"
        '<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "San Francisco, CA", '
        '"unit": "celsius"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>'
    )
    check_format("hermes", text, "Let me check both.", [("get_current_weather", WEATHER), ("get_time", TIME)])


def test_hermes_escapes_and_braces_inside_strings():
    args = {"query": 'say "hi" {not a brace} \\ done', "n": [1, {"a": None}], "ok": True, "x": -1.5e3}
    text = f'<tool_call>{{"name": "search", "arguments": {json.dumps(args)}}}</tool_call>'
    check_format("hermes", text, None, [("search", args)])


def test_hermes_plain_text_and_malformed_fall_back_to_content():
    check_format("hermes", "Paris is the capital of France.", "Paris is the capital of France.", [])
    bad = "<tool_call>\n{name: get_weather}\n</tool_call>"
    check_format("hermes", bad, bad, [])
    unfinished = '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Par'
    assert parser_for("hermes").message(unfinished, [])["content"] == unfinished


def test_hermes_streaming_holds_a_half_arrived_marker():
    p = parser_for("hermes")
    assert p.delta("Sure <tool", [], final=False).get("content") == "Sure"
    d = p.delta('Sure <tool_call>{"name": "f"', [], final=False)
    assert d["tool_calls"][0]["function"]["name"] == "f" and "content" not in d


# ---------------------------------------------------------------- llama3_json (Llama 3.1-3.3 model cards)


def test_llama3_json_parameters_form():
    text = '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}'
    args = {"location": "San Francisco, CA", "unit": "Fahrenheit"}
    check_format("llama3_json", text, None, [("get_current_conditions", args)])


def test_llama3_json_python_tag_type_field_and_several_calls():
    text = (
        '<|python_tag|>{"type": "function", "name": "get_current_weather", "parameters": '
        + json.dumps(WEATHER)
        + '}; {"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}'
    )
    check_format("llama3_json", text, None, [("get_current_weather", WEATHER), ("get_time", TIME)])


def test_llama3_json_plain_text_is_content():
    check_format("llama3_json", "The weather is sunny.", "The weather is sunny.", [])
    check_format("llama3_json", '{"not": "a call"}', '{"not": "a call"}', [])


# ---------------------------------------------------------------- mistral


def test_mistral_v3_array():
    text = '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": ' + json.dumps(WEATHER) + "}]"
    check_format("mistral", text, None, [("get_current_weather", WEATHER)])
    two = '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "San Francisco, CA", '
    two += '"unit": "celsius"}}, {"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}]'
    check_format("mistral", two, None, [("get_current_weather", WEATHER), ("get_time", TIME)])


def test_mistral_v11_name_args_form():
    text = (
        "[TOOL_CALLS]get_current_weather[ARGS]"
        + json.dumps(WEATHER)
        + '[TOOL_CALLS]get_time[ARGS]{"timezone": "Europe/Paris"}'
    )
    check_format("mistral", text, None, [("get_current_weather", WEATHER), ("get_time", TIME)])


def test_mistral_ids_are_nine_alphanumerics_and_bad_output_is_content():
    msg = parser_for("mistral").message("[TOOL_CALLS]f[ARGS]{}", [])
    (call,) = msg["tool_calls"]
    assert len(call["id"]) == 9 and call["id"].isalnum()
    check_format("mistral", "[TOOL_CALLS] [{oops", "[TOOL_CALLS] [{oops", [])
    check_format("mistral", "No tools needed.", "No tools needed.", [])


# ---------------------------------------------------------------- deepseek_v3 (V3 / R1 chat template)


def _ds_call(name: str, args: dict) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{json.dumps(args)}\n```{CALL_END}"


def test_deepseek_v3_calls():
    text = CALLS_BEGIN + _ds_call("get_current_weather", WEATHER) + _ds_call("get_time", TIME) + CALLS_END
    check_format("deepseek_v3", text, None, [("get_current_weather", WEATHER), ("get_time", TIME)])
    check_format(
        "deepseek_v3", "Checking.\n\n" + text, "Checking.", [("get_current_weather", WEATHER), ("get_time", TIME)]
    )


def test_deepseek_v31_short_block():
    text = f"{CALLS_BEGIN}{CALL_BEGIN}get_time{SEP}" + json.dumps(TIME) + f"{CALL_END}{CALLS_END}"
    check_format("deepseek_v3", text, None, [("get_time", TIME)])


def test_deepseek_v3_malformed_is_content():
    bad = f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_time\n```json\n{{broken\n```{CALL_END}{CALLS_END}"
    assert parser_for("deepseek_v3").message(bad, []) == {"role": "assistant", "content": bad}
    # streamed, the call began (its name and a valid "{") before the arguments went wrong: what
    # was sent stays, and the arguments stop at the last valid prefix
    s = stream(parser_for("deepseek_v3"), bad)
    assert s["calls"][0]["name"] == "get_time" and s["calls"][0]["arguments"] == "{"
    assert s["content"] == ""  # and its text does not come again as content


# ---------------------------------------------------------------- openai (harmony): the message mapping


def test_harmony_messages_map_to_calls_content_and_reasoning():
    from atomc.serve.harmony_stream import HarmonyMessage, reasoning_text, visible_text
    from atomc.serve.tool_parsers.harmony import tool_parse

    msgs = [
        HarmonyMessage("analysis", None, "User asks for weather; call the tool."),
        HarmonyMessage("commentary", None, "Checking the weather."),
        HarmonyMessage("commentary", "functions.get_current_weather", json.dumps(WEATHER)),
        HarmonyMessage("final", None, "It is sunny", complete=False),
    ]
    parsed = tool_parse(msgs)
    assert [(c.name, json.loads(c.arguments), c.complete) for c in parsed.calls] == [
        ("get_current_weather", WEATHER, True)
    ]
    assert parsed.content == visible_text(msgs) == "Checking the weather.It is sunny"
    assert reasoning_text(msgs) == "User asks for weather; call the tool."


def _local_harmony_vocab() -> bool:
    # only a local vocabulary file: without one the package would try to download it
    base = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    return bool(base) and (Path(base) / "o200k_base.tiktoken").is_file()


@pytest.mark.skipif(
    not _local_harmony_vocab(),
    reason="openai-harmony's GPT-OSS encoding needs o200k_base.tiktoken in a folder named by TIKTOKEN_ENCODINGS_BASE",
)
def test_harmony_parsers_read_token_ids():
    from atomc.serve.harmony_stream import harmony_encoding

    enc = harmony_encoding()
    text = (
        "<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_current_weather <|constrain|>json"
        "<|message|>" + json.dumps(WEATHER) + "<|call|>"
    )
    ids = enc.encode(text, allowed_special="all")
    setup = ChatOutputSetup(reasoning_parser="openai", tool_mode="auto", tool_parser="openai")
    msg = setup.choice_parser(None).message("", ids)
    assert msg["reasoning_content"] == "Need the weather."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("get_current_weather", WEATHER)
    ]
    streamed = setup.choice_parser(None)
    args = ""
    for n in range(1, len(ids) + 1):
        for tc in streamed.delta("", ids[:n], final=n == len(ids)).get("tool_calls", []):
            args += tc["function"]["arguments"]
    assert json.loads(args) == WEATHER


# ---------------------------------------------------------------- constrained modes (required / named)


def test_required_schema_and_parser():
    tools = [
        {"type": "function", "function": {"name": "get_current_weather", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "get_time"}},
    ]
    schema = required_schema(tools, parallel=True)
    assert schema["minItems"] == 1 and "maxItems" not in schema
    assert [b["properties"]["name"] for b in schema["items"]["anyOf"]] == [
        {"const": "get_current_weather"},
        {"const": "get_time"},
    ]
    assert required_schema(tools, parallel=False)["maxItems"] == 1
    text = json.dumps(
        [{"name": "get_current_weather", "parameters": WEATHER}, {"name": "get_time", "parameters": TIME}]
    )
    p = ChoiceParser(None, RequiredCallsParser(tools), reports_reasoning=False)
    msg = p.message(text, [])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("get_current_weather", WEATHER),
        ("get_time", TIME),
    ]
    s = stream(ChoiceParser(None, RequiredCallsParser(tools), reports_reasoning=False), text)
    assert [(c["name"], json.loads(c["arguments"])) for c in s["calls"].values()] == [
        ("get_current_weather", WEATHER),
        ("get_time", TIME),
    ]
    assert ChoiceParser(None, RequiredCallsParser(tools), False).message("[]", [])["content"] == "[]"
    # cut by max_tokens inside the array: the complete calls stand, the cut one is dropped
    cut = text[: text.index('"get_time"') + 12]
    msg = ChoiceParser(None, RequiredCallsParser(tools), False).message(cut, [])
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_current_weather"]
    assert ChoiceParser(None, RequiredCallsParser(tools), False).message(text[:20], [])["content"] == text[:20]


def test_named_parser_streams_the_whole_output_as_arguments():
    text = json.dumps(WEATHER)
    msg = ChoiceParser(None, NamedFunctionParser("get_current_weather"), False).message(text, [])
    assert msg["content"] is None and json.loads(msg["tool_calls"][0]["function"]["arguments"]) == WEATHER
    s = stream(ChoiceParser(None, NamedFunctionParser("get_current_weather"), False), text)
    assert s["calls"][0]["name"] == "get_current_weather" and json.loads(s["calls"][0]["arguments"]) == WEATHER


# ---------------------------------------------------------------- reasoning


def reasoning(name: str, prompt: str | None = None, tools: str | None = None) -> ChoiceParser:
    tool_parser = tool_parser_class(tools)() if tools else None
    return ChoiceParser(reasoning_parser_class(name)(prompt), tool_parser, reports_reasoning=True)


def test_qwen3_think_block():
    text = "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"
    msg = reasoning("qwen3").message(text, [])
    assert msg["reasoning_content"] == msg["reasoning"] == "The user greets me.\n"
    assert msg["content"] == "Hello! How can I help?"
    s = stream(reasoning("qwen3"), text)
    assert s["reasoning"] == "The user greets me.\n" and s["content"] == "Hello! How can I help?"


def test_qwen3_without_think_is_content_and_prompt_can_open_or_close_the_block():
    assert reasoning("qwen3").message("Just an answer.", [])["reasoning_content"] is None
    assert stream(reasoning("qwen3"), "Just an answer.")["content"] == "Just an answer."
    opened = reasoning("qwen3", prompt="<|im_start|>assistant\n<think>\n").message("why</think>because", [])
    assert (opened["reasoning_content"], opened["content"]) == ("why", "because")
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # enable_thinking false
    assert reasoning("deepseek_r1", prompt=closed).message("plain answer", [])["content"] == "plain answer"


def test_deepseek_r1_output_holds_only_the_closing_tag():
    text = "Let me think about 2+2.\n</think>\n\n4"
    msg = reasoning("deepseek_r1", prompt="<｜Assistant｜><think>\n").message(text, [])
    assert (msg["reasoning_content"], msg["content"]) == ("Let me think about 2+2.\n", "4")
    s = stream(reasoning("deepseek_r1"), text)
    assert (s["reasoning"], s["content"]) == ("Let me think about 2+2.\n", "4")
    cut = reasoning("deepseek_r1").message("still thinking when cut off", [])
    assert (cut["reasoning_content"], cut["content"]) == ("still thinking when cut off", "")


def test_tool_calls_are_read_after_the_reasoning():
    call = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>'
    text = "<think>I should not call <tool_call> here.</think>\n\n" + call
    msg = reasoning("qwen3", tools="hermes").message(text, [])
    assert msg["reasoning_content"] == "I should not call <tool_call> here."
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_time"]
    s = stream(reasoning("qwen3", tools="hermes"), text)
    assert s["reasoning"] == "I should not call <tool_call> here." and s["calls"][0]["name"] == "get_time"


# ---------------------------------------------------------------- the scanner and the registries


def test_json_scan_partial_values():
    s = '{"name": "f", "arguments": {"a": "}\\"", "b": [1, 2'
    scan = scan_object(s, 0)
    assert scan.string(s, "name") == "f" and scan.end is None
    assert scan.raw(s, "arguments") == '{"a": "}\\"", "b": [1, 2'
    assert value_end("123", 0) is None and value_end("123,", 0) == 3
    with pytest.raises(ValueError):
        scan_object('{"a" 1}', 0)
    assert hold_back("abc<tool_c", "<tool_call>") == "abc" and hold_back("abc", "<tool_call>") == "abc"


def test_registries_name_every_parser_and_refuse_unknown_names():
    for name in TOOL_PARSERS:
        if name != "openai":
            assert tool_parser_class(name).name == name
    for name in REASONING_PARSERS:
        assert reasoning_parser_class(name).name == name
    with pytest.raises(ValueError, match="hermes"):
        tool_parser_class("nope")
    with pytest.raises(ValueError, match="qwen3"):
        reasoning_parser_class("nope")
