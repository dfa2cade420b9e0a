"""The Triton MLA kernel on CUDA in bf16 at DeepSeek-V3's widths (128 heads, kv_lora 512, rope 64,
pages of 16) against atomc::mla_attention's torch reference, its capture in a CUDA graph, and the
DeepSeek engine with CUDA graphs against the eager one."""

import gc

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

from triton_kernel_cases import make_batch, rel_err  # noqa: E402

from atomc.ops.attention import paged_attention_reference  # noqa: E402

DEV, BF16, REL = "cuda", torch.bfloat16, 1e-2
HEADS, LORA, ROPE = 128, 512, 64
SCALE = 192**-0.5


def latent_batch(q_lens, seq_lens, seed=0):
    q, cache, _, meta = make_batch(q_lens, seq_lens, HEADS, 1, LORA + ROPE, BF16, DEV, seed=seed)
    return q[..., :LORA], q[..., LORA:], cache, meta


def reference(q_absorbed, q_pe, cache, meta):
    out = torch.zeros(*q_absorbed.shape, dtype=q_absorbed.dtype, device=DEV)
    paged_attention_reference(torch.cat([q_absorbed, q_pe], -1), cache, cache[..., :LORA], out, meta, SCALE)
    return out


def run(q_absorbed, q_pe, cache, meta, out, **kw):
    from atomc.kernels.triton import mla_attention

    mla_attention(
        q_absorbed, q_pe, cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, SCALE,
        meta.max_query_len, meta.max_seq_len, meta.num_seqs, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("reduce_cols", [0, 32], ids=["merge_whole_rows", "merge_in_32_column_pieces"])
@pytest.mark.parametrize("segments", [1, 8, None])
@pytest.mark.parametrize(
    "q_lens,seq_lens",
    [
        ([1] * 4, [1, 77, 1024, 3000]),  # decode, uneven contexts
        ([1], [8192]),  # one long context: split-KV's case
        ([200, 37], [200, 901]),  # prefill, and a chunk over a cached prefix
        ([1, 64, 1, 5], [513, 64, 33, 700]),  # mixed
    ],
    ids=["decode", "long_decode", "prefill", "mixed"],
)
def test_mla_v3_widths_bf16(q_lens, seq_lens, segments, reduce_cols):
    q_absorbed, q_pe, cache, meta = latent_batch(q_lens, seq_lens)
    out = torch.full(q_absorbed.shape, float("nan"), dtype=BF16, device=DEV)
    run(q_absorbed, q_pe, cache, meta, out, num_segments=segments, reduce_cols=reduce_cols)
    t = meta.query_start_loc_host[-1]
    assert not out[:t].isnan().any() and out[t:].isnan().all()
    assert rel_err(out[:t], reference(q_absorbed, q_pe, cache, meta)[:t]) < REL


def test_mla_decode_replays_in_a_cuda_graph_with_new_lengths():
    """Captured once at an upper-bound max_seq_len, replayed after the lengths grew: the kernel
    reads the lengths on the device, so the replay matches the reference for the new lengths."""
    q_absorbed, q_pe, cache, meta = latent_batch([1] * 8, [2048] * 8)
    out = torch.zeros(q_absorbed.shape, dtype=BF16, device=DEV)
    meta.seq_lens.fill_(100)
    meta.max_seq_len = 2048  # the bound, as the decode graphs pass it
    run(q_absorbed, q_pe, cache, meta, out)  # warm-up: compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(q_absorbed, q_pe, cache, meta, out)
    lens = [5, 300, 2048, 1500, 17, 999, 1024, 64]
    meta.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    meta.seq_lens_host = lens
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out[:8], reference(q_absorbed, q_pe, cache, meta)[:8]) < REL


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_engine_with_cuda_graphs_matches_eager(family, checkpoints):
    """The tiny DeepSeek checkpoints on CUDA in fp32: decode CUDA graphs (now captured: the MLA
    op runs its Triton kernel) give the eager engine's greedy tokens, and were replayed."""
    from atomc import LLM, SamplingParams

    prompts = [list(range(5, 5 + n)) for n in (3, 40, 9, 77)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # a fixed pool: sized from free memory, the second engine of the process found none left (an
    # earlier engine's memory is not all returned, even after gc and empty_cache: seen on the H200)
    kw = dict(model=str(checkpoints[family]), dtype="float32", device=DEV, max_num_seqs=8, num_kv_blocks=256)

    def tokens(llm):
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]

    def release():  # an engine's KV cache takes most of the free memory: free it before the next engine
        gc.collect()
        torch.cuda.empty_cache()

    eager_llm = LLM(enforce_eager=True, **kw)
    eager = tokens(eager_llm)
    del eager_llm
    release()
    llm = LLM(**kw)
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.use_graphs and graphs.graphs
    replays = []
    launch = graphs._launch
    graphs._launch = lambda key: replays.append(key) or launch(key)
    assert tokens(llm) == eager
    assert replays
    del llm, graphs
    release()
