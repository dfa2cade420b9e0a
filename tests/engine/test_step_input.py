"""The engine's step record (engine/step_input.py) from the scheduler's output, and the per-layer KV
spec reaching the runner (no sliding-window cap on the context length)."""

from __future__ import annotations

import json
import pickle
import shutil

from atomc import LLM, SamplingParams
from atomc.config import SchedulerConfig
from atomc.engine.block_manager import BlockManager
from atomc.engine.scheduler import Scheduler
from atomc.engine.sequence import Sequence
from atomc.engine.step_input import build_step_input
from atomc.kv_spec import PagedAttentionSpec
from atomc.runtime.batch import PENDING_TOKEN


def seq(i: int, prompt: list[int], **params) -> Sequence:
    s = Sequence(i, str(i), 1, list(prompt), len(prompt), SamplingParams(max_tokens=50, **params))
    s.max_num_tokens = len(prompt) + 50
    return s


def test_record_of_a_chunked_prefill_next_to_a_pending_decode():
    blocks = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), blocks)
    a = seq(0, list(range(10, 16)), seed=5, repetition_penalty=1.2)
    sched.add(a)
    sched.commit_computed(sched.schedule())
    a.num_pending, a.pending_row = 1, 3  # its next input was sampled at row 3 of launch 7
    b = seq(1, list(range(20, 29)), prompt_logprobs=1)
    sched.add(b)
    sched.config.max_num_batched_tokens = 6  # b gets a 5-token chunk
    scheduled = sched.schedule()
    step, samplers = build_step_input(scheduled, 4, 8, 7, [42])
    assert step.seq_ids == [0, 1] and step.query_lens == [1, 5] and step.context_lens == [6, 0]
    assert step.block_tables == [a.block_table, b.block_table]
    assert step.input_ids == [PENDING_TOKEN, 20, 21, 22, 23, 24]
    assert step.positions == [6, 0, 1, 2, 3, 4]
    bs = 4
    slot = lambda s, p: s.block_table[p // bs] * bs + p % bs  # noqa: E731
    assert step.slot_mapping == [slot(a, 6)] + [slot(b, p) for p in range(5)]
    # only a samples (b's chunk stops short of its prompt); a reads its history and is seeded
    assert step.sample_rows == [0] and step.sample_seq_ids == [0] and samplers == [a]
    assert step.token_history == {0: (a.prompt_token_ids, [])}
    assert step.seeds == {0: 5 + a.index}
    assert (step.feed_rows, step.feed_sources, step.feed_step) == ([0], [3], 7)
    (req,) = step.prompt_logprobs  # rows 0..4 of b score prompt tokens 1..5
    assert (req.seq_id, req.first_row, req.top_n, req.target_ids) == (1, 1, 1, [21, 22, 23, 24, 25])
    assert step.finished_seq_ids == [42]
    assert pickle.loads(pickle.dumps(step)) == step


def test_scheduler_reports_finished_sequences_once():
    sched = Scheduler(SchedulerConfig(), BlockManager(num_blocks=8, block_size=4))
    a = seq(0, [1, 2, 3])
    sched.add(a)
    sched.schedule()
    sched.finish(a, "abort")
    assert sched.take_finished() == [0]
    assert sched.take_finished() == []


def test_per_layer_windows_reach_the_kv_specs_and_do_not_cap_the_context(checkpoints, tmp_path):
    model_dir = tmp_path / "mistral"
    shutil.copytree(checkpoints["mistral"], model_dir)
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["sliding_window"] = 32
    cfg["layer_types"] = ["full_attention", "sliding_attention"]  # one layer of each
    cfg_path.write_text(json.dumps(cfg))
    eng = LLM(model=str(model_dir), device="cpu", enforce_eager=True, dtype="float32").engine
    assert eng.max_model_len == cfg["max_position_embeddings"]  # not the window
    a, runner = eng.arch, eng.runner
    assert runner.kv_specs == [PagedAttentionSpec(a.num_kv_heads, a.head_dim, w) for w in (None, 32)]
    (k0, _), (k1, _) = runner.kv_caches  # unequal specs: a pool each, same page shape
    assert k0.shape[1:] == k1.shape[1:] and k0.untyped_storage().data_ptr() != k1.untyped_storage().data_ptr()
    # a KV group each; here max_model_len (512) <= a chunk, so the window saves nothing: equal needs,
    # and the windowed pool has one more block (its null block)
    assert runner.group_num_blocks[1] == runner.group_num_blocks[0] + 1 == k1.shape[0]
