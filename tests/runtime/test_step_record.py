"""The runner driven by hand-built step records (runtime/batch.py), checked against a plain forward
of each whole sequence: several query rows per sequence with several sampled rows each, pending
inputs fed from an earlier launch, prompt logprobs in the result, on the eager path and on the
uniform-query decode graphs (run without capture on the CPU)."""

from __future__ import annotations

import pickle

import pytest
import torch

from atomc import SamplingParams
from atomc.runtime.batch import PENDING_TOKEN, PromptLogprobRequest, StepInput, slots_for
from atomc.runtime.cudagraph import DecodeGraphs
from tests.engine.helpers import make

BLOCK = 16
PROMPTS = [[5, 9, 13, 17, 21, 25, 29], list(range(40, 70)), [7, 8, 9]]
LOGPROBS = SamplingParams(temperature=0, logprobs=1)


def record(step_id, contexts, queries, ids, sampled_per_seq, **kw) -> StepInput:
    """Sequence i (blocks 4i..4i+3) computes `queries[i]` tokens after `contexts[i]` cached ones;
    its last `sampled_per_seq[i]` rows are sampled."""
    seq_ids, tables, positions, slots, rows, row_seqs = [], [], [], [], [], []
    row = 0
    for i, (c, q) in enumerate(zip(contexts, queries, strict=True)):
        table = list(range(4 * i, 4 * i + 4))
        seq_ids.append(i)
        tables.append(table)
        positions.extend(range(c, c + q))
        slots.extend(slots_for(table, c, c + q, BLOCK))
        k = sampled_per_seq[i]
        rows.extend(range(row + q - k, row + q))
        row_seqs.extend([i] * k)
        row += q
    return StepInput(
        step_id, seq_ids, list(queries), list(contexts), tables, ids, positions, slots,
        rows, row_seqs, [LOGPROBS] * len(rows), **kw,
    )  # fmt: skip


def reference(runner, tokens: list[int]) -> torch.Tensor:
    """Log-softmax of every row of one whole sequence, without any cache (one causal sequence)."""
    with torch.inference_mode():
        ids = torch.tensor(tokens)
        hidden = runner.forward(ids, torch.arange(len(tokens)))
        return torch.log_softmax(runner.model.compute_logits(hidden), -1)


@pytest.fixture
def runner(llama_dir):
    return make(llama_dir, max_model_len=64, num_kv_blocks=16).engine.runner


def prefill(runner, sampled: int):
    """Step 0: every prompt whole, its last `sampled` rows sampled."""
    ids = [t for p in PROMPTS for t in p]
    step = record(0, [0] * 3, [len(p) for p in PROMPTS], ids, [sampled] * 3)
    return step, runner.launch(step).result()


def check_rows(runner, result, rows_of_seq: dict[int, list[tuple[list[int], int]]]) -> None:
    """rows_of_seq[seq] = [(tokens up to and including the row's input, k)]: sampled row k of the
    result predicts the next token of that prefix."""
    for prefixes in rows_of_seq.values():
        for prefix, k in prefixes:
            ref = reference(runner, prefix)[-1]
            token = result.token_ids[k]
            assert token == int(ref.argmax())
            assert result.logprobs[k][token] == pytest.approx(ref[token].item(), abs=1e-4)


def test_step_input_pickles():
    step = record(3, [0, 5], [2, 1], [1, 2, PENDING_TOKEN], [2, 1], feed_rows=[2], feed_sources=[0], feed_step=2,
                  seeds={0: 7}, token_history={1: ([1, 2], [3])}, finished_seq_ids=[9],
                  prompt_logprobs=[PromptLogprobRequest(0, 0, 2, [2])])  # fmt: skip
    back = pickle.loads(pickle.dumps(step))
    assert back == step and back is not step


@pytest.mark.parametrize("path", ["eager", "graph"])
def test_two_query_rows_and_two_samples_per_sequence(runner, path):
    """Step 0 samples the last two prompt rows of each sequence; step 1 feeds both tokens back as
    pending inputs (two query rows per sequence, both sampled)."""
    calls = []
    if path == "graph":
        graphs = DecodeGraphs(runner.forward, runner.model.compute_logits, runner.kv_caches, [2, 4], 4, 64, "cpu",
                              query_lens=(1, 2), capture=False)  # fmt: skip
        launch = graphs._launch
        graphs._launch = lambda key: calls.append(key) or launch(key)
        runner.decode_graphs = graphs
    _, first = prefill(runner, sampled=2)
    # sampled rows of step 0: seq i owns rows 2i (predicts from its second-to-last token) and 2i+1
    check_rows(runner, first, {i: [(p[:-1], 2 * i), (p, 2 * i + 1)] for i, p in enumerate(PROMPTS)})
    # step 1 feeds each sequence its two step-0 tokens as inputs: positions len(p), len(p)+1
    step = record(1, [len(p) for p in PROMPTS], [2] * 3, [PENDING_TOKEN] * 6, [2] * 3,
                  feed_rows=list(range(6)), feed_sources=list(range(6)), feed_step=0)  # fmt: skip
    second = runner.launch(step).result()
    expected = {}
    for i, p in enumerate(PROMPTS):
        seq = p + first.token_ids[2 * i : 2 * i + 2]
        expected[i] = [(seq[:-1], 2 * i), (seq, 2 * i + 1)]
    check_rows(runner, second, expected)
    if path == "graph":
        assert calls == [(4, 2)]  # 3 sequences of 2 rows, padded to 4 sequences; step 0 was not uniform
    else:
        assert runner.decode_graphs is None


def test_prompt_logprobs_come_back_in_the_result(runner):
    p = PROMPTS[1]
    step = record(0, [0], [len(p)], list(p), [1],
                  prompt_logprobs=[PromptLogprobRequest(0, 0, 2, p[1:])])  # fmt: skip
    result = runner.launch(step).result()
    ref = reference(runner, p)
    entries = result.prompt_logprobs[0]
    assert len(entries) == len(p) - 1
    for j, entry in enumerate(entries):
        target = p[j + 1]
        assert entry[target] == pytest.approx(ref[j, target].item(), abs=1e-4)
        assert set(ref[j].topk(2).indices.tolist()) <= set(entry)
    assert not hasattr(runner, "prompt_logprobs")  # no side channel on the runner


def test_a_step_that_only_scores_the_prompt_returns_its_logprobs(runner):
    p = PROMPTS[1]
    step = record(0, [0], [10], list(p[:10]), [0], prompt_logprobs=[PromptLogprobRequest(0, 0, 0, p[1:11])])
    pending = runner.launch(step)
    result = pending.result()
    assert result.token_ids == [] and len(result.prompt_logprobs[0]) == 10


def test_feeding_from_a_launch_that_was_not_the_last_fails(runner):
    prefill(runner, sampled=1)
    step = record(1, [7], [1], [PENDING_TOKEN], [1], feed_rows=[0], feed_sources=[0], feed_step=5)
    with pytest.raises(RuntimeError, match="feeds inputs from step 5"):
        runner.launch(step)


def test_seeded_generators_are_freed_with_their_sequences(llama_dir):
    llm = make(llama_dir)
    runner = llm.engine.runner
    llm.generate("The capital of France is", SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=4))
    assert len(runner._generators) == 2  # one per seeded sequence, still held: no step since
    llm.generate("1 2 3", SamplingParams(temperature=0, max_tokens=2))
    assert runner._generators == {}


def test_batch_arrays_pad_rows_and_sequences():
    import numpy as np

    from atomc.runtime.batch import write_batch_arrays

    step = record(0, [3, 0], [1, 2], [11, 12, 13], [1, 1])
    shapes = {"input_ids": 8, "positions": 8, "slot_mapping": 8, "query_start_loc": 5, "seq_lens": 4}
    arrays = {k: np.full(n, 99, np.int64) for k, n in shapes.items()} | {"block_tables": np.full((4, 6), 99, np.int32)}
    width = write_batch_arrays(step, arrays, num_tokens=7, num_seqs=4, pad_query_len=2)
    assert width == 4
    assert arrays["input_ids"][:8].tolist() == [11, 12, 13, 0, 0, 0, 0, 99]  # padded rows: id 0
    assert arrays["positions"][:7].tolist() == [3, 0, 1, 0, 0, 0, 0]
    assert arrays["slot_mapping"][:7].tolist() == step.slot_mapping + [-1] * 4  # padded rows write no KV
    assert arrays["query_start_loc"].tolist() == [0, 1, 3, 5, 7]  # two padded sequences of 2 rows
    assert arrays["seq_lens"].tolist() == [4, 2, 2, 2]
    assert arrays["block_tables"][:, :4].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [0] * 4, [0] * 4]
    write_batch_arrays(step, arrays, num_tokens=4, num_seqs=4, pad_query_len=0)  # mixed graphs: empty padding
    assert arrays["query_start_loc"].tolist() == [0, 1, 3, 3, 3] and arrays["seq_lens"].tolist() == [4, 2, 0, 0]
