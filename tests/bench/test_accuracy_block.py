"""The accuracy block: its spec, the lm-eval request it builds, its gates, and lm-eval end to end
(against an oracle that answers right, and against `atomc serve` on a tiny random llama)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fastapi import FastAPI, Request

from atomc.bench import arith
from atomc.bench.blocks import SuiteContext, accuracy
from tests.bench.block_servers import completion, fake_server, tiny_llama_server

FLEX = "atomc_arith.exact_match__flexible-extract"
STRICT = "atomc_arith.exact_match__strict-match"
needs_lm_eval = pytest.mark.skipif(accuracy.lm_eval_available() is not None, reason=str(accuracy.lm_eval_available()))


def ctx_for(tmp_path: Path, base_url: str = "http://127.0.0.1:9", model: str = "m", thresholds=None) -> SuiteContext:
    return SuiteContext(
        base_url=base_url,
        model=model,
        out_dir=tmp_path / "out",
        config_dir=tmp_path,
        thresholds=thresholds or {},
        log=lambda _msg: None,
    )


# --- spec and request --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tasks, message",
    [
        ([{"id": "a", "task": "x", "bogus": 1}], "unknown field"),
        ([{"id": "a", "task": "x"}, {"id": "a", "task": "y"}], "duplicate accuracy task id"),
        ([{"id": "a", "task": "x", "tasks": ["y"]}], "disagree"),
        ([{"id": "a"}], "set `task` or `tasks`"),
        ([{"task": "x"}], "string `id`"),
        ([{"id": "a", "task": "x", "lm_eval_model": "hf"}], "lm_eval_model"),
        ([{"id": "a", "task": "x", "seed": [1, 2]}], "seed"),
    ],
)
def test_bad_specs_are_config_errors(tmp_path, tasks, message):
    result = accuracy.run({"tasks": tasks}, ctx_for(tmp_path))
    assert result.verdict == "ERROR" and "config error" in result.reason and message in result.reason


def test_request_points_lm_eval_at_the_server(tmp_path):
    task = {"id": "a", "tasks": "atomc_arith, gsm8k", "include_path": "my_tasks", "num_fewshot": 5, "limit": 10,
            "gen_kwargs": {"max_gen_toks": 8}, "seed": [1, 2, 3, 4], "extra_model_args": "max_length=4096"}  # fmt: skip
    req = accuracy.build_request(task, ctx_for(tmp_path, "http://h:1/", "served"))
    assert req["model"] == "local-completions" and req["tasks"] == ["atomc_arith", "gsm8k"]
    args = req["model_args"]
    assert args["base_url"] == "http://h:1/v1/completions" and args["model"] == "served"
    assert args["tokenized_requests"] is False and args["tokenizer_backend"] is None and args["max_length"] == "4096"
    # the shipped tasks are always on the path; the user's resolves next to the config
    assert req["include_path"] == [str(accuracy.SHIPPED_TASKS), str(tmp_path / "my_tasks")]
    ev = req["evaluate"]
    assert (ev["num_fewshot"], ev["limit"], ev["gen_kwargs"]) == (5, 10, {"max_gen_toks": 8})
    assert (ev["random_seed"], ev["numpy_random_seed"], ev["torch_random_seed"], ev["fewshot_random_seed"]) == (
        1,
        2,
        3,
        4,
    )


def test_chat_template_selects_the_chat_model_and_a_tokenizer_the_hf_backend(tmp_path):
    req = accuracy.build_request(
        {"id": "a", "task": "t", "apply_chat_template": True, "tokenizer": "tok"}, ctx_for(tmp_path)
    )
    assert req["model"] == "local-chat-completions"
    assert req["model_args"]["base_url"].endswith("/v1/chat/completions")
    assert req["model_args"]["tokenizer_backend"] == "huggingface"
    assert req["model_args"]["tokenizer"] == str(tmp_path / "tok")
    with pytest.raises(accuracy.AccuracySpecError, match="cannot set"):
        accuracy.build_request({"id": "a", "task": "t", "extra_model_args": "model=x"}, ctx_for(tmp_path))


def test_results_are_projected_with_cvs_names():
    results = {"gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.5, "exact_match_stderr,strict-match": 0.1,
                         "exact_match,flexible-extract": 0.75, "bad": float("nan"), "flag": True}}  # fmt: skip
    assert accuracy.project(results) == {
        "gsm8k.exact_match__strict-match": 0.5,
        "gsm8k.exact_match_stderr__strict-match": 0.1,
        "gsm8k.exact_match__flexible-extract": 0.75,
    }


def test_gates():
    metrics = {FLEX: 0.4, STRICT: 0.2}
    [row] = accuracy.gate_task("a", metrics, {FLEX: {"kind": "min", "value": 0.5}})
    assert row["status"] == "FAIL" and row["reason"] == "0.4 not >= 0.5"
    [row] = accuracy.gate_task("a", metrics, {FLEX: {"kind": "min", "value": 0.4}})
    assert row["status"] == "PASS"
    # a metric the task did not produce is a typo: FAIL, naming the ones it did
    [row] = accuracy.gate_task("a", metrics, {"atomc_arith.exact_match__flexible_extract": {"kind": "min", "value": 0}})
    assert row["status"] == "FAIL" and FLEX in row["reason"]
    for specs in (None, {}, {"_comment": "calibrate later"}):
        [row] = accuracy.gate_task("a", metrics, specs)
        assert row["status"] == "INFO"


# --- lm-eval end to end ------------------------------------------------------------------------


def oracle_app():
    """Answers every atomc_arith question with its worked answer: a perfect score."""
    gold = {row["question"]: row["answer"] for row in arith.generate(*arith.SPLITS["test"][1:])}
    app = FastAPI()
    app.state.prompts = []

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.prompts.append(body)
        question = body["prompt"].rsplit("Question: ", 1)[-1].rsplit("\nAnswer:", 1)[0]
        return completion(" " + gold.get(question, "I do not know."))

    return app


@needs_lm_eval
def test_an_oracle_scores_one_and_passes(tmp_path):
    app = oracle_app()
    thresholds = {"accuracy": {"arith": {FLEX: {"kind": "min", "value": 0.99}, STRICT: {"kind": "min", "value": 0.99}}}}
    with fake_server(app) as url:
        spec = {"tasks": [{"id": "arith", "task": "atomc_arith", "limit": 4, "num_concurrent": 2}]}
        result = accuracy.run(spec, ctx_for(tmp_path, url, "oracle", thresholds))
    assert result.verdict == "PASS", result.reason
    assert result.metrics[f"arith/{FLEX}"] == 1.0 and result.metrics[f"arith/{STRICT}"] == 1.0
    assert len(app.state.prompts) == 4 and app.state.prompts[0]["model"] == "oracle"
    assert app.state.prompts[0]["temperature"] == 0
    samples = json.loads((tmp_path / "out" / "accuracy" / "arith" / "samples.json").read_text())
    rows = samples["atomc_arith"]
    assert len(rows) == 8 and {r["filter"] for r in rows} == {"strict-match", "flexible-extract"}
    assert all(r["response"] == [arith.final_answer(r["target"])] for r in rows)


USER_TASK = """task: my_sums
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: exact_match
generation_kwargs:
  until: ["Q:"]
  max_gen_toks: 8
"""


def sums_app():
    """Answers "Q: what is a plus b?" with the sum, except for the last question."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        a, b = map(int, re.findall(r"(\d+) plus (\d+)", (await request.json())["prompt"])[-1])
        return completion("0" if a == 3 else str(a + b))  # exact match: no leading space

    return app


@needs_lm_eval
def test_a_users_own_task_runs_by_name_from_include_path(tmp_path):
    """A task lm-eval does not ship, in a folder next to the config, found by its name."""
    tasks = tmp_path / "my_tasks"
    tasks.mkdir()
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"question": f"what is {a} plus {a}?", "answer": str(2 * a)}) + "\n"
                            for a in (1, 2, 3, 4)))  # fmt: skip
    (tasks / "my_sums.yaml").write_text(USER_TASK.format(data=data))
    thresholds = {"accuracy": {"mine": {"my_sums.exact_match__none": {"kind": "min", "value": 0.8}}}}
    with fake_server(sums_app()) as url:
        spec = {"tasks": [{"id": "mine", "task": "my_sums", "include_path": "my_tasks"}]}
        result = accuracy.run(spec, ctx_for(tmp_path, url, "m", thresholds))
    assert result.verdict == "FAIL", result.reason
    assert result.metrics["mine/my_sums.exact_match__none"] == 0.75  # 3 of 4
    assert "0.75 not >= 0.8" in result.reason


@needs_lm_eval
def test_an_unknown_task_is_an_error_naming_it(tmp_path):
    result = accuracy.run({"tasks": [{"id": "x", "task": "no_such_task_anywhere"}]}, ctx_for(tmp_path))
    assert result.verdict == "ERROR" and "no_such_task_anywhere" in result.reason


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    from tests.conftest import build_checkpoint

    model_dir = build_checkpoint("llama", tmp_path_factory.mktemp("acc_llama"))
    with tiny_llama_server(model_dir) as (url, name):
        yield url, name


@needs_lm_eval
def test_accuracy_end_to_end_on_atomc_serve(tiny_server, tmp_path):
    """Three problems, 8 tokens each, one-shot, on a random model: it scores ~0, so a 0.5 floor
    fails (the gate logic on real lm-eval output from the real server)."""
    url, name = tiny_server
    spec = {"tasks": [{"id": "gated", "task": "atomc_arith", "limit": 3, "num_fewshot": 1, "num_concurrent": 2,
                       "gen_kwargs": {"max_gen_toks": 8}}]}  # fmt: skip
    thresholds = {"accuracy": {"gated": {FLEX: {"kind": "min", "value": 0.5}}}}
    result = accuracy.run(spec, ctx_for(tmp_path, url, name, thresholds))
    assert result.verdict == "FAIL", result.reason
    assert "gated" in result.reason and FLEX in result.reason
    [row] = result.rows
    assert row["status"] == "FAIL" and [g["status"] for g in row["gates"]] == ["FAIL"]
    assert 0.0 <= row["metrics"][FLEX] <= 1.0 and STRICT in row["metrics"]
    assert row["n_samples"]["atomc_arith"]["effective"] == 3
    assert set(result.metrics) >= {f"gated/{FLEX}", f"gated/{STRICT}"}
