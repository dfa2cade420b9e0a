import torch
from pass_helpers import apply, arch, assert_same, attention, capture, ops, run

from atomc.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from atomc.passes.canonicalize import Canonicalize
from atomc.passes.fuse_rope_kv_write import FuseRopeKVWrite
from atomc.passes.noop_elimination import NoopElimination
from models.layers.rotary import RotaryEmbedding

A = arch()
torch.manual_seed(0)
ATTN, ROPE = attention(A), RotaryEmbedding(A.head_dim, 64, 10000.0, None)
PAGE, BLOCKS = 4, [2, 0, 3, 1]  # one sequence over shuffled pages


def graphs():
    gm, inputs = capture(lambda p, x: ATTN(p, x, ROPE), torch.arange(5), torch.randn(5, A.hidden_size))
    _, clean = apply(NoopElimination(), gm)
    _, canon = apply(Canonicalize(), clean)
    result, after = apply(FuseRopeKVWrite(), canon)
    return gm, inputs, result, after, canon


def context(start: int, n: int, caches) -> ForwardContext:
    pos = list(range(start, start + n))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([BLOCKS[p // PAGE] * PAGE + p % PAGE for p in pos]),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([start + n], dtype=torch.int32),
        block_tables=torch.tensor([BLOCKS], dtype=torch.int32),
        query_start_loc_host=[0, n],
        seq_lens_host=[start + n],
        max_query_len=n,
        max_seq_len=start + n,
        num_seqs=1,
    )
    return ForwardContext(meta, [caches])


def with_inputs(inputs, positions, x):
    """The captured inputs with the positions and hidden states replaced (sizes follow)."""
    out = []
    for v in inputs:
        if isinstance(v, torch.Tensor) and v.dtype == torch.int64 and v.dim() == 1:
            out.append(positions)
        elif isinstance(v, torch.Tensor) and v.shape[-1:] == (A.hidden_size,) and v.dim() == 2 and v.shape[0] == 5:
            out.append(x)
        elif isinstance(v, int) and v == 5:
            out.append(positions.numel())
        else:
            out.append(v)
    return out


def assert_same_over_prefill_and_decode(before, after, inputs, a) -> None:
    """Prefill 6 tokens, then decode one, through each graph with its own paged cache: the same
    outputs and the same cache contents."""
    shape = (len(BLOCKS), PAGE, a.num_kv_heads, a.head_dim)
    caches = {g: (torch.zeros(shape), torch.zeros(shape)) for g in ("before", "after")}
    x = torch.randn(7, a.hidden_size)
    for start, n in ((0, 6), (6, 1)):
        step = with_inputs(inputs, torch.arange(start, start + n), x[start : start + n])
        outs = {}
        for name, g in (("before", before), ("after", after)):
            with set_forward_context(context(start, n, caches[name])):
                outs[name] = run(g, step)
        assert_same(outs["before"], outs["after"])
        assert_same(caches["before"], caches["after"])
    assert caches["after"][0].abs().sum() > 0  # the fused op did write the cache


def test_attention_splits_into_rope_kv_write_and_paged_attention():
    gm, inputs, result, after, canon = graphs()
    assert ops(canon)["atomc.rope"] == 1 and ops(canon)["atomc.attention"] == 1
    assert (result.matched, result.rewritten) == (1, 1)
    counts = ops(after)
    assert counts["atomc.rope_and_write_kv"] == 1 and counts["atomc.paged_attention"] == 1
    assert counts["atomc.rope"] == 0 and counts["atomc.attention"] == 0
    assert_same(run(gm, inputs), run(after, inputs))  # no cache: one causal sequence


def test_same_cache_and_outputs_over_prefill_and_decode():
    gm, inputs, _, after, _ = graphs()
    assert_same_over_prefill_and_decode(gm, after, inputs, A)


def windowed_graphs(window):
    torch.manual_seed(0)
    attn = attention(arch(sliding_window=window))
    attn.load_state_dict(ATTN.state_dict())
    gm, inputs = capture(lambda p, x: attn(p, x, ROPE), torch.arange(5), torch.randn(5, A.hidden_size))
    _, canon = apply(Canonicalize(), apply(NoopElimination(), gm)[1])
    result, after = apply(FuseRopeKVWrite(), canon)
    return gm, inputs, result, after


def attention_windows(gm, target) -> list:
    return [n.args[6] if len(n.args) > 6 else n.kwargs.get("sliding_window", 0)
            for n in gm.graph.nodes if n.op == "call_function" and n.target in target]  # fmt: skip


def test_sliding_window_survives_the_split():
    """The window on atomc.attention moves to the paged_attention that replaces it, and the fused graph
    computes the windowed result over prefill and decode (7 tokens, window 3)."""
    gm, inputs, result, after = windowed_graphs(3)
    assert result.rewritten == 1
    assert attention_windows(gm, ATTENTION_TARGETS) == [3]
    assert attention_windows(after, (torch.ops.atomc.paged_attention.default,)) == [3]
    assert_same_over_prefill_and_decode(gm, after, inputs, A)
    # and the window is live: a full-attention graph gives other outputs over the same steps
    full, full_inputs, _, _ = windowed_graphs(0)
    assert attention_windows(full, ATTENTION_TARGETS) == [0]
    x = torch.randn(6, A.hidden_size)
    outs = []
    for g, ins in ((gm, inputs), (full, full_inputs)):
        shape = (len(BLOCKS), PAGE, A.num_kv_heads, A.head_dim)
        with set_forward_context(context(0, 6, (torch.zeros(shape), torch.zeros(shape)))):
            outs.append(run(g, with_inputs(ins, torch.arange(6), x)))
    assert not torch.allclose(outs[0][0], outs[1][0], atol=1e-4)


ATTENTION_TARGETS = (torch.ops.atomc.attention, torch.ops.atomc.attention.default)


def sink_graphs(window):
    """A GPT-OSS-style attention (sinks, window) traced and split."""
    from models.layers.attention import LlamaStyleAttention
    from tests.passes.pass_helpers import randomize

    torch.manual_seed(0)
    attn = randomize(LlamaStyleAttention(A.hidden_size, A.num_heads, A.num_kv_heads, A.head_dim, 0,
                                         qkv_bias=True, o_bias=True, sliding_window=window, sinks=True))  # fmt: skip
    with torch.no_grad():
        attn.sinks.copy_(torch.randn(A.num_heads) * 2)
    gm, inputs = capture(lambda p, x: attn(p, x, ROPE), torch.arange(5), torch.randn(5, A.hidden_size))
    _, canon = apply(Canonicalize(), apply(NoopElimination(), gm)[1])
    result, after = apply(FuseRopeKVWrite(), canon)
    return gm, inputs, result, after, attn


def test_sinks_survive_the_split():
    """The sinks on atomc.attention move to the paged_attention that replaces it (as its last
    argument), with the window; the fused graph gives the same outputs and cache over prefill and
    decode; and a dense graph's paged_attention keeps its seven arguments."""
    for window in (0, 3):
        gm, inputs, result, after, attn = sink_graphs(window)
        assert result.rewritten == 1
        (paged,) = [n for n in after.graph.nodes if n.target is torch.ops.atomc.paged_attention.default]
        assert len(paged.args) == 8 and paged.args[6] == window
        sink_arg = paged.args[7]
        assert sink_arg.op in ("get_attr", "placeholder")
        assert_same_over_prefill_and_decode(gm, after, inputs, A)
    _, _, _, dense, _ = graphs()
    (paged,) = [n for n in dense.graph.nodes if n.target is torch.ops.atomc.paged_attention.default]
    assert len(paged.args) == 7
