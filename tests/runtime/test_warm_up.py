"""The start-up forwards at the prefill sizes between the decode graphs and the sizing forward, so
Triton kernels compile the variants those steps pick before serving (CUDA; here their sizes, and the
forwards themselves on the CPU runner)."""

from __future__ import annotations

from atomc.runtime.capture_sizes import decode_graph_sizes, warm_up_sizes
from tests.engine.helpers import make


def test_sizes_lie_strictly_between_the_decode_graphs_and_the_sizing_forward():
    assert warm_up_sizes(256, 8192) == [512, 1024, 2048, 4096]
    assert warm_up_sizes(64, 2048) == [128, 256, 512, 1024]
    assert warm_up_sizes(100, 1024) == [128, 256, 512]
    assert warm_up_sizes(256, 512) == []  # the sizing forward covers it
    assert warm_up_sizes(4, 16) == [8]
    assert warm_up_sizes(0, 64) == [1, 2, 4, 8, 16, 32]  # no graphs: every decode batch too


def test_the_graphs_set_where_the_sizes_start():
    assert max(decode_graph_sizes(None, 256, 8192)) == 256  # the default ladder reaches max_num_seqs
    assert decode_graph_sizes([1, 2, 4, 8, 300], 256, 8192) == [1, 2, 4, 8]  # only decode batches
    # capture sizes up to 8: batches of 9..256 run eagerly, so the warm-up starts above 8
    assert warm_up_sizes(max(decode_graph_sizes([1, 2, 4, 8], 256, 8192)), 8192)[:3] == [16, 32, 64]


def test_each_size_is_one_forward_over_its_tokens(llama_dir, monkeypatch):
    llm = make(llama_dir, max_model_len=64, num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=128)
    runner = llm.engine.runner
    seen = []
    real = runner._profile_forward

    def forward(ids, positions):
        seen.append((ids.numel(), int(positions.max()) + 1))
        return real(ids, positions)

    monkeypatch.setattr(runner, "_profile_forward", forward)
    # the CPU engine runs eagerly (no graphs): from one token; a prompt is at most max_model_len (64)
    assert runner.warm_up_prefill_sizes() == [1, 2, 4, 8, 16, 32, 64]
    assert seen == [(n, n) for n in (1, 2, 4, 8, 16, 32, 64)]
