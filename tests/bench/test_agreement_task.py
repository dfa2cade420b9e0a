"""The offline `atomc_agreement` task: deterministic English minimal pairs, each a grammatical
sentence and the same sentence with one word changed, and lm-eval scoring them on `atomc serve`."""

from __future__ import annotations

import collections

import pytest

from atomc.bench import agreement
from atomc.bench.blocks import accuracy
from tests.bench.block_servers import tiny_llama_server
from tests.bench.test_accuracy_block import ctx_for, needs_lm_eval

ACC = "atomc_agreement.acc__none"


def test_same_seed_same_pairs_other_seed_others():
    assert agreement.generate(3, 50) == agreement.generate(3, 50)
    assert agreement.generate(3, 50) != agreement.generate(4, 50)


def test_each_row_is_a_minimal_pair_and_the_phenomena_are_balanced():
    rows = agreement.generate(agreement.SEED, agreement.ROWS)
    assert len({r["good"] for r in rows}) == len(rows)  # no pair twice
    counts = collections.Counter(r["phenomenon"] for r in rows)
    assert set(counts) == set(agreement.PHENOMENA) and set(counts.values()) == {len(rows) // len(counts)}
    for r in rows:
        good, bad = r["good"].split(), r["bad"].split()
        assert len(good) == len(bad) and sum(g != b for g, b in zip(good, bad, strict=True)) == 1, r
        assert r["good"][0].isupper() and r["good"].endswith(".")


@pytest.mark.parametrize(
    "phenomenon, good_word, bad_word",
    [("subject_verb_attractor", {"is", "are", "was", "were"}, {"is", "are", "was", "were"}),
     ("determiner_noun", {"this", "that", "these", "those"}, {"this", "that", "these", "those"}),
     ("reflexive_number", {"himself", "herself", "themselves"}, {"himself", "herself", "themselves"}),
     ("irregular_past", {g for g, _ in agreement.PAST}, {b for _, b in agreement.PAST})],
)  # fmt: skip
def test_the_changed_word_is_the_phenomenons(phenomenon, good_word, bad_word):
    for r in agreement.generate(0, 100):
        if r["phenomenon"] != phenomenon:
            continue
        [(g, b)] = [(g, b) for g, b in zip(r["good"].split(), r["bad"].split(), strict=True) if g != b]
        assert g.strip(".") in good_word and b.strip(".") in bad_word, r


def test_shipped_file_is_what_the_generator_writes(tmp_path):
    written = agreement.write_task_data(tmp_path)
    shipped = agreement.TASK_DIR / written.name
    assert shipped.read_bytes() == written.read_bytes(), f"{shipped} is stale: run python -m atomc.bench.agreement"
    assert (agreement.TASK_DIR / "atomc_agreement.yaml").is_file()


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    from tests.conftest import build_checkpoint

    model_dir = build_checkpoint("llama", tmp_path_factory.mktemp("agree_llama"))
    with tiny_llama_server(model_dir) as (url, name):
        yield url, name, model_dir


@needs_lm_eval
def test_agreement_scores_by_log_likelihood_on_atomc_serve(tiny_server, tmp_path):
    """lm-eval's loglikelihood requests (echo + logprobs; the checkpoint's tokenizer on the client)
    against the real server on a tiny random llama: every pair is scored, the accuracy is a share."""
    url, name, model_dir = tiny_server
    spec = {"tasks": [{"id": "agree", "task": "atomc_agreement", "limit": 6, "num_concurrent": 2,
                       "tokenizer": str(model_dir)}]}  # fmt: skip
    result = accuracy.run(spec, ctx_for(tmp_path, url, name))
    assert result.verdict == "PASS", result.reason  # no gate: recorded only
    [row] = result.rows
    assert row["n_samples"]["atomc_agreement"]["effective"] == 6
    assert row["metrics"][ACC] in {i / 6 for i in range(7)} and result.metrics[f"agree/{ACC}"] == row["metrics"][ACC]
