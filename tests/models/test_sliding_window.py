"""A Mistral checkpoint whose sliding window is shorter than its prompts: atomc's greedy tokens equal
transformers' (whose Mistral masks keys at or before position p - sliding_window, as atomc does),
through plain prefill, chunked prefill over a cached prefix longer than the window, and decode far
past it. The engine serves the model's full context, not just the window."""

from __future__ import annotations

import pytest
import torch
import transformers

from atomc import LLM, SamplingParams
from tests.conftest import FAMILIES, build_checkpoint

WINDOW = 8
PROMPTS = [
    "The capital of France is Paris. The capital of Italy is Rome. Once upon a time",
    "def add(a, b):\n    return a + b\n1 2 3 4 5 6 7 8 9 10 hello world",
]


@pytest.fixture(scope="module")
def mistral_window_dir(tmp_path_factory, monkeypatch_module):
    spec = dict(FAMILIES["mistral"], sliding_window=WINDOW)
    monkeypatch_module.setitem(FAMILIES, "mistral_window", spec)
    return build_checkpoint("mistral_window", tmp_path_factory.mktemp("mistral_window"))


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.parametrize("chunk", [None, 8])
def test_greedy_tokens_match_transformers_past_the_window(mistral_window_dir, chunk):
    hf = transformers.AutoModelForCausalLM.from_pretrained(mistral_window_dir, dtype=torch.float32).eval()
    assert hf.config.sliding_window == WINDOW
    kw = dict(max_num_batched_tokens=chunk) if chunk else {}  # chunks of 8 tokens: a cached prefix
    llm = LLM(model=str(mistral_window_dir), dtype="float32", device="cpu", enforce_eager=True, **kw)
    assert llm.engine.arch.sliding_window == WINDOW
    assert llm.engine.max_model_len == 512  # max_position_embeddings, not the window
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert ids.shape[1] > 2 * WINDOW  # the prompt alone is longer than the window
        ref = hf.generate(ids, do_sample=False, max_new_tokens=24, min_new_tokens=24)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist()


def test_window_changes_the_logits(mistral_window_dir):
    # the window is live in atomc's model: without it, the last position's logits differ
    from models.loader import load_model

    model = load_model(mistral_window_dir, torch.float32, "cpu")
    ids = torch.randint(0, model.arch.vocab_size, (30,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        windowed = model.compute_logits(model(ids, torch.arange(30)))
        for layer in model.model.layers:
            layer.self_attn.sliding_window = 0
        full = model.compute_logits(model(ids, torch.arange(30)))
    torch.testing.assert_close(windowed[:WINDOW], full[:WINDOW], atol=1e-5, rtol=1e-5)
    assert (windowed[-1] - full[-1]).abs().max() > 1e-3


# -- sliding-window layers beside full ones: a KV-cache group (block pool) each ------------------------

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
LONG = " ".join(PROMPTS) + " And then the window slid on past every block it had read before."


@pytest.fixture(scope="module")
def mixed_dir(tmp_path_factory, monkeypatch_module):
    spec = dict(FAMILIES["qwen2"], sliding_window=WINDOW, use_sliding_window=True, layer_types=LAYER_TYPES)
    monkeypatch_module.setitem(FAMILIES, "qwen2_mixed", spec)
    return build_checkpoint("qwen2_mixed", tmp_path_factory.mktemp("qwen2_mixed"), num_layers=4)


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """Transformers' greedy tokens, each step a whole forward through its masks, no KV cache: its
    generate() with these mixed layers (transformers 5.24) strays from that on the shorter prompts,
    while atomc matches it (and its own plain forward)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


def mixed_llm(model_dir, **kw) -> LLM:
    kw.setdefault("block_size", 4)  # blocks of 4 tokens: windows of 8 release blocks early and often
    kw.setdefault("num_kv_blocks", 512)  # the full pool; the windowed one in proportion (fast to allocate)
    return LLM(model=str(model_dir), dtype="float32", device="cpu", enforce_eager=True, **kw)


def watch_window_tables(llm: LLM) -> list[int]:
    """Record, per step, the most live blocks a scheduled sequence holds in the windowed pool, and
    check its released entries hold the null block."""
    from atomc.engine.block_manager import NULL_BLOCK

    sched, most = llm.engine.scheduler, []
    schedule = sched.schedule

    def watched():
        out = schedule()
        if out:
            for item in out:
                s = item.seq
                assert s.block_tables[1][: s.released_blocks[1]] == [NULL_BLOCK] * s.released_blocks[1]
            most.append(max(len(i.seq.block_tables[1]) - i.seq.released_blocks[1] for i in out))
        return out

    sched.schedule = watched
    return most


@pytest.mark.parametrize("chunk", [None, 8])
def test_mixed_layers_match_transformers_and_free_behind_the_window(mixed_dir, chunk):
    hf = transformers.AutoModelForCausalLM.from_pretrained(mixed_dir, dtype=torch.float32).eval()
    assert [layer.self_attn.sliding_window for layer in hf.model.layers] == [WINDOW, None, WINDOW, None]
    kw = dict(max_num_batched_tokens=chunk) if chunk else {}
    llm = mixed_llm(mixed_dir, **kw)
    runner = llm.engine.runner
    assert [g.sliding_window for g in runner.kv_groups] == [None, WINDOW] and runner.layer_group == [1, 0, 1, 0]
    most = watch_window_tables(llm)
    prompts = [*PROMPTS, LONG]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, params)
    tok = llm.get_tokenizer()
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert ids.shape[1] > (6 if prompt is LONG else 2) * WINDOW  # several windows long
        assert out.outputs[0].token_ids == hf_greedy(hf, ids[0].tolist(), 24)
    # decode steps hold the window (7 keys + the query: at most 3 blocks of 4); a chunk more
    step_chunk = chunk or max(len(tok(p).input_ids) for p in prompts)
    assert max(most) <= -(-(WINDOW - 1 + step_chunk) // 4) + 1 and min(most) <= 3
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]  # every block of both pools back
    # the same tokens with prefix caching off
    off = mixed_llm(mixed_dir, enable_prefix_caching=False, **kw).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in off] == [o.outputs[0].token_ids for o in outs]


def evict(pool, block_id: int) -> None:
    block = pool.blocks[block_id]
    del pool.cached[block.hash]
    block.hash = None


@pytest.mark.parametrize("lose", [None, "behind_window", "inside_window"])
def test_prefix_hit_across_window_and_full_layers(mixed_dir, lose):
    """A second request extends a cached prompt: its hit spans the full layers' blocks and the
    windowed layers' last window, and its tokens equal a run without the cache. The windowed pool
    may have lost blocks behind the window (the hit stands) or inside it (the hit shortens)."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = mixed_llm(mixed_dir)
    tok = llm.get_tokenizer()
    first = tok(LONG).input_ids
    second = first + tok(" Later, a second question came.").input_ids
    llm.generate([{"prompt_token_ids": first}], params)
    eng = llm.engine
    full_pool, window_pool = eng.block_pools
    cached_blocks = len(first) // 4
    want_hit = cached_blocks * 4
    # the first prompt's chained block hashes, as the scheduler computes them for the second
    probe = eng.scheduler._match_groups(second, (len(second) - 1) // 4)[1][:cached_blocks]
    assert all(h in full_pool.cached and h in window_pool.cached for h in probe)
    if lose == "behind_window":  # long released: a hit at the end of the prompt does not read them
        for h in probe[: cached_blocks - 3]:
            evict(window_pool, window_pool.cached[h])
    elif lose == "inside_window":  # every hit longer than cached_blocks - 1 reads this one
        evict(window_pool, window_pool.cached[probe[-1]])
        want_hit = None
    out = llm.generate([{"prompt_token_ids": second}], params)[0]
    if want_hit is not None:
        assert out.num_cached_tokens == want_hit > 2 * WINDOW
    else:
        assert 0 < out.num_cached_tokens < cached_blocks * 4
    ref = mixed_llm(mixed_dir, enable_prefix_caching=False).generate([{"prompt_token_ids": second}], params)[0]
    assert ref.num_cached_tokens == 0
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_windowed_layers_take_less_of_the_kv_memory(mixed_dir):
    """The memory split follows what each group needs at max_model_len: with chunks of 32 the window
    group needs 11 blocks a sequence against 128 for the full one, so the full-attention layers hold
    far more tokens than if every layer kept every block, and more longest sequences fit at once."""
    from atomc.runtime.kv_cache import bytes_per_block

    llm = mixed_llm(mixed_dir, max_num_batched_tokens=32, num_kv_blocks=None)  # sized from the memory budget
    runner = llm.engine.runner
    needs, _ = runner.kv_group_needs()
    assert needs == [128, 11]
    all_full = int(llm.config.cache.cpu_kv_cache_gib * 2**30) // bytes_per_block(runner.kv_specs, 4, torch.float32)
    full_blocks, window_blocks = runner.group_num_blocks
    assert full_blocks * 4 > 1.8 * all_full * 4  # KV capacity in tokens of context
    longest = min(full_blocks // 128, (window_blocks - 1) // 11)
    assert longest > 1.8 * (all_full // 128)
    k_full, k_window = runner.kv_caches[1][0], runner.kv_caches[0][0]
    assert (k_full.shape[0], k_window.shape[0]) == (full_blocks, window_blocks)


def mixed_tokens(llm: LLM, prompts, max_tokens: int = 16) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_mixed_layers_preempted_by_a_small_pool_keep_their_tokens(mixed_dir):
    prompts = [*PROMPTS, LONG, PROMPTS[0] + " again"]
    want = mixed_tokens(mixed_llm(mixed_dir), prompts)
    # 48 full blocks (192 tokens) for five sequences of up to 140: the newest are preempted and
    # recomputed, in chunks of 16 that start at every offset relative to the window
    llm = mixed_llm(mixed_dir, num_kv_blocks=48, max_model_len=160, max_num_batched_tokens=16)
    assert mixed_tokens(llm, prompts) == want
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == stats["num_total_blocks"]


def test_graph_buffers_hold_a_block_table_per_group(mixed_dir):
    # the CUDA-graph paths without capture (CPU): their static buffers carry each group's slots and
    # tables, and every layer reads its group's; tokens equal the plain eager forward's
    from atomc.runtime.cudagraph import DecodeGraphs, MixedGraphs

    prompts = [*PROMPTS, LONG]
    want = mixed_tokens(mixed_llm(mixed_dir, max_num_batched_tokens=24, max_num_seqs=4), prompts)
    llm = mixed_llm(mixed_dir, max_num_batched_tokens=24, max_num_seqs=4)
    r = llm.engine.runner
    blocks = r.max_model_len // r.block_size
    kw = dict(capture=False, layer_group=r.layer_group)
    r.mixed_graphs = MixedGraphs(r.forward, r.kv_caches, [8, 16, 32], 4, blocks, r.max_model_len, "cpu", **kw)
    r.decode_graphs = DecodeGraphs(
        r.forward, r.model.compute_logits, r.kv_caches, [1, 2, 4], blocks, r.max_model_len, "cpu", **kw
    )
    assert set(r.decode_graphs.group_buffers) == {"slot_mapping_1", "block_tables_1"}
    calls = []
    for graphs in (r.mixed_graphs, r.decode_graphs):
        launch = graphs._launch
        graphs._launch = lambda key, launch=launch: calls.append(key) or launch(key)
    assert mixed_tokens(llm, prompts) == want
    assert any(isinstance(k, int) for k in calls) and any(isinstance(k, tuple) for k in calls)
