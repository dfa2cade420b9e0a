"""The static-buffer batch paths of the CUDA graphs (runtime/cudagraph.py), run without capture on
the CPU: filling the buffers, padding, and reading the outputs back must give the same tokens as
the plain forward, for pure-decode batches and for mixed batches with chunked prefill."""

from __future__ import annotations

import pytest

from atomc import LLM, SamplingParams
from atomc.runtime.cudagraph import DecodeGraphs, MixedGraphs, default_mixed_sizes

PROMPTS = [[5, 9, 13, 17, 21, 25, 29], list(range(40, 90)), [7, 7, 7], list(range(100, 137))]


def generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [o.outputs[0].token_ids for o in outs]


def make_llm(llama_dir) -> LLM:
    # a 24-token budget splits the 50-token prompt into chunks that share steps with decodes
    return LLM(model=str(llama_dir), device="cpu", enforce_eager=True, max_model_len=128,
               num_kv_blocks=64, max_num_batched_tokens=24, max_num_seqs=4)  # fmt: skip


@pytest.fixture(scope="module")
def reference(llama_dir) -> list[list[int]]:
    return generate(make_llm(llama_dir))


def attach_graphs(llm: LLM, mixed_sizes: list[int], decode_sizes: list[int]) -> tuple[MixedGraphs, DecodeGraphs]:
    r = llm.engine.runner
    blocks = 128 // r.block_size
    r.mixed_graphs = MixedGraphs(r.forward, r.kv_caches, mixed_sizes, 4, blocks, 128, "cpu", capture=False)
    r.decode_graphs = DecodeGraphs(
        r.forward, r.model.compute_logits, r.kv_caches, decode_sizes, blocks, 128, "cpu", capture=False
    )
    return r.mixed_graphs, r.decode_graphs


def count_calls(graphs) -> list[int]:
    calls = []
    launch = graphs._launch

    def counted(size):
        calls.append(size)
        return launch(size)

    graphs._launch = counted
    return calls


def test_static_batch_paths_match_plain_forward(llama_dir, reference):
    llm = make_llm(llama_dir)
    mixed, decode = attach_graphs(llm, [8, 16, 32], [1, 2, 4])
    mixed_calls, decode_calls = count_calls(mixed), count_calls(decode)
    assert generate(llm) == reference
    assert mixed_calls and set(mixed_calls) <= {8, 16, 32}  # prefill and mixed steps, padded up
    assert decode_calls and set(decode_calls) <= {(1, 1), (2, 1), (4, 1)}  # (sequences, query rows each)


def test_padded_rows_ignore_what_the_staging_buffers_held(llama_dir, reference):
    """Rows past the batch must not read leftovers: an out-of-range position there sent RoPE's table
    lookup out of bounds (on a GPU, an illegal memory access in the captured graph)."""
    llm = make_llm(llama_dir)
    mixed, decode = attach_graphs(llm, [8, 16, 32], [8])  # every decode batch (4 or fewer) is padded
    for graphs in (mixed, decode):
        for name in ("input_ids", "positions"):
            graphs.staging_np[name][:] = 10**12
    decode_calls = count_calls(decode)
    assert generate(llm) == reference
    assert decode_calls


def test_batches_larger_than_the_graphs_fall_back(llama_dir, reference):
    llm = make_llm(llama_dir)
    mixed, _ = attach_graphs(llm, [8], [1])
    mixed_calls = count_calls(mixed)
    assert generate(llm) == reference
    assert set(mixed_calls) == {8}


def test_default_mixed_sizes():
    assert default_mixed_sizes(1024, 8192) == [16, 32, 64, 128, 256, 384, 512, 768, 1024]
    assert default_mixed_sizes(1024, 300) == [16, 32, 64, 128, 256, 300]
    assert default_mixed_sizes(0, 8192) == []
