"""The long-context (NIAH, ACC-12) block: prompts, token counting, scoring, gates; end to end
against fake servers (one that retrieves, one that cannot, with and without /tokenize) and
against `atomc serve` on a tiny random llama."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from fastapi import FastAPI, Request

from atomc.bench.blocks import SuiteContext, long_context
from tests.bench.block_servers import MAX_MODEL_LEN, completion, fake_server, tiny_llama_server


def ctx_for(tmp_path: Path, base_url: str, model: str = "m", thresholds=None, params=None) -> SuiteContext:
    return SuiteContext(
        base_url=base_url, model=model, out_dir=tmp_path, config_dir=tmp_path, thresholds=thresholds or {},
        params=params or {}, log=lambda _msg: None,
    )  # fmt: skip


def words(text: str) -> int:
    return len(text.split())


# --- prompts and scoring -----------------------------------------------------------------------


def test_needle_sits_at_its_depth():
    filler = long_context.filler_sentences(3, 40)
    _city, number, sentence = long_context.needle(random.Random(0))
    for depth in (0.0, 0.25, 0.5, 1.0):
        prompt = long_context.build_prompt(filler, depth, sentence, "Oslo", chat=False)
        body = prompt[len(long_context.INSTRUCTION) :].split("\n\nQuestion:")[0]
        before, after = body.split(sentence)
        at = round(depth * 40)
        assert before == " ".join(filler[:at]) + (" " if at else "")
        assert after == (" " if at < 40 else "") + " ".join(filler[at:])
        assert prompt.count(number) == 1 and prompt.endswith("The secret number of Oslo is")


def test_filler_never_mentions_a_number_or_the_question():
    text = " ".join(long_context.filler_sentences(1, 500))
    assert not re.search(r"\d", text) and "secret" not in text


@pytest.mark.parametrize(
    "answer, ok",
    [(" 4821337.", True), ("It is 4,821,337", True), ("4 821 337", True), ("48213370", False), ("4821", False),
     ("", False), (None, False)],
)  # fmt: skip
def test_retrieved(answer, ok):
    assert long_context.retrieved(answer, "4821337") is ok


def test_spread_depths():
    assert long_context.spread_depths(1) == [0.5]
    assert long_context.spread_depths(5) == [0.0, 0.25, 0.5, 0.75, 1.0]


@pytest.mark.parametrize("target", [60, 200, 999, 5000])
def test_fit_filler_is_at_most_the_target_and_within_a_sentence(target):
    counts = []

    def count(text):
        counts.append(1)
        return words(text)

    filler, measured = long_context.fit_filler(target, 5, count, chat=False)
    _c, number, _s = long_context.needle(random.Random(5))
    city = max(long_context.CITIES, key=len)
    prompt = long_context.build_prompt(filler, 0.5, f"The secret number of {city} is {number}.", city, chat=False)
    longest = max(words(s) for s in long_context.filler_sentences(5, len(filler) + 1))
    assert measured == words(prompt) <= target
    assert target - measured <= longest
    assert len(counts) <= 12  # a few counts, not a sentence-by-sentence search


def test_fit_filler_survives_a_server_that_refuses_long_prompts():
    # the usage counter returns None for a prompt over the server's context
    filler, measured = long_context.fit_filler(300, 1, lambda t: words(t) if words(t) <= 350 else None, chat=True)
    assert measured <= 300 and len(filler) > 0
    with pytest.raises(long_context.NiahSpecError, match="shorter than the question"):
        long_context.fit_filler(5, 1, words, chat=False)


@pytest.mark.parametrize(
    "cells, message",
    [
        ([{"id": "a"}], "set `isl` or `lengths`"),
        ([{"id": "a", "isl": 100, "depths": [0.5, 2]}], "depths"),
        ([{"id": "a", "isl": 100}, {"id": "a", "isl": 200}], "duplicate"),
        ([{"id": "a", "isl": 100, "needle": "x"}], "unknown field"),
        ([{"id": "a", "isl": 100, "endpoint": "responses"}], "endpoint"),
        ([{"id": "a", "lengths": ["x"]}], "integers"),
    ],
)
def test_bad_cells_are_config_errors(tmp_path, cells, message):
    result = long_context.run({"cells": cells}, ctx_for(tmp_path, "http://127.0.0.1:9"))
    assert result.verdict == "ERROR" and message in result.reason


def test_gates_by_cell_id():
    row = {"id": "c", "pass_rate": 0.5}
    name = long_context.metric_name("c")
    assert name == "accuracy.niah_pass_rate__c"
    [g] = long_context.gate_cell(row, {name: {"kind": "min", "value": 0.6}})
    assert g["status"] == "FAIL"
    [g] = long_context.gate_cell(row, {name: {"kind": "min", "value": 0.5}})
    assert g["status"] == "PASS"
    [g] = long_context.gate_cell(row, {"accuracy.niah_pass_rate__other": {"kind": "min", "value": 0}})
    assert g["status"] == "FAIL" and name in g["reason"]
    [g] = long_context.gate_cell(row, {})
    assert g["status"] == "INFO"


# --- end to end against fakes ------------------------------------------------------------------


def niah_app(knows: bool, tokenize: bool) -> FastAPI:
    """Counts tokens as words; answers with the needle's number when `knows`, else a wrong one."""
    app = FastAPI()
    app.state.bodies = []

    if tokenize:

        @app.post("/tokenize")
        async def tok(request: Request):
            body = await request.json()
            return {"count": words(body["prompt"]), "max_model_len": 100000}

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "m", "max_model_len": 3000}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.bodies.append(body)
        found = re.search(r"The secret number of \w+ is (\d+)\.", body["prompt"])
        answer = found.group(1) if found and knows else "1234567"  # no needle: a length probe
        return completion(f" {answer}.", words(body["prompt"]))

    return app


@pytest.mark.parametrize("tokenize", [True, False])
def test_a_retriever_passes_and_lengths_are_counted_by_the_server(tmp_path, tokenize):
    app = niah_app(knows=True, tokenize=tokenize)
    name = long_context.metric_name("c")
    thresholds = {"long_context_accuracy": {"c": {name: {"kind": "min", "value": 1.0}}}}
    spec = {"cells": [{"id": "c", "lengths": [300, 1200], "depths": [0, 0.5, 1], "num_prompts": 6, "osl": 8}]}
    with fake_server(app) as url:
        result = long_context.run(spec, ctx_for(tmp_path, url, thresholds=thresholds))
    assert result.verdict == "PASS", result.reason
    assert result.metrics == {name: 1.0}
    [row] = result.rows
    assert row["length_source"] == ("tokenize" if tokenize else "usage")
    assert {(g["length"], g["depth"]) for g in row["grid"]} == {(n, d) for n in (300, 1200) for d in (0.0, 0.5, 1.0)}
    for g in row["grid"]:
        assert g["prompts"] == 2 and g["retrieved"] == 2
        assert g["prompt_tokens"] <= g["length"] and g["length"] - g["prompt_tokens"] < 30
    asked = [b for b in app.state.bodies if b["max_tokens"] == 8]
    assert len(asked) == 12 and all(b["temperature"] == 0 for b in asked)
    assert len({re.search(r"is (\d+)\.", b["prompt"]).group(1) for b in asked}) == 12  # a needle each


def test_a_model_that_cannot_retrieve_fails_and_too_long_cells_skip(tmp_path):
    name = long_context.metric_name("c")
    thresholds = {"long_context_accuracy": {"c": {name: {"kind": "min", "value": 0.5}}}}
    spec = {"cells": [{"id": "c", "isl": 400, "num_prompts": 3}, {"id": "long", "isl": 4000}]}
    with fake_server(niah_app(knows=False, tokenize=True)) as url:
        result = long_context.run(spec, ctx_for(tmp_path, url, thresholds=thresholds))
    assert result.verdict == "FAIL" and "0 not >= 0.5" in result.reason
    c, long = result.rows
    assert c["pass_rate"] == 0.0 and [g["depth"] for g in c["grid"]] == [0.0, 0.5, 1.0]
    assert long["status"] == "SKIP" and "max model length 3000" in long["reason"]
    # params.max_model_length (the config's) caps lengths too
    with fake_server(niah_app(knows=True, tokenize=True)) as url:
        result = long_context.run(
            {"cells": [spec["cells"][0]]}, ctx_for(tmp_path, url, params={"max_model_length": 300})
        )
    assert result.verdict == "SKIP" and "max model length 300" in result.reason


# --- end to end on atomc serve -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    from tests.conftest import build_checkpoint

    model_dir = build_checkpoint("llama", tmp_path_factory.mktemp("niah_llama"))
    with tiny_llama_server(model_dir) as (url, name):
        yield url, name


def test_niah_end_to_end_on_atomc_serve(tiny_server, tmp_path):
    """atomc serve has /tokenize (vLLM's shape): lengths are counted there. The random model
    retrieves nothing, so a floor fails; a length past the context is skipped, not sent."""
    url, name = tiny_server
    metric = long_context.metric_name("short")
    thresholds = {"long_context_accuracy": {"short": {metric: {"kind": "min", "value": 0.5}}}}
    spec = {"cells": [{"id": "short", "lengths": [160, 320], "depths": [0, 1], "num_prompts": 2, "osl": 4},
                      {"id": "past_context", "isl": MAX_MODEL_LEN}]}  # fmt: skip
    result = long_context.run(spec, ctx_for(tmp_path, url, name, thresholds))
    assert result.verdict == "FAIL", result.reason
    short, past = result.rows
    assert short["length_source"] == "tokenize" and short["pass_rate"] == 0.0
    for g in short["grid"]:
        assert g["errors"] == [] and g["prompts"] == 1
        # within a filler sentence under the length (this byte-level test tokenizer spends ~40
        # tokens on one), and each prompt's own needle moves it by a few tokens at most
        assert g["length"] - 60 <= g["prompt_tokens"] <= g["length"] + 8, g
    assert past["status"] == "SKIP"
    assert result.metrics == {metric: 0.0}
