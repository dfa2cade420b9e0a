"""fuse_allreduce_rmsnorm: all-reduce -> residual add -> RMSNorm becomes atomc::all_reduce_add_rms_norm,
only where the reduced sum has no other reader, and only in a tensor-parallel pipeline; the fused
graph gives the unfused graph's numbers over two gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pass_helpers import apply, assert_same, capture, ops, run

from atomc.ops import collective
from atomc.passes import PassManager
from atomc.passes.canonicalize import Canonicalize
from atomc.passes.fuse_add_rmsnorm import FuseAddRMSNorm
from atomc.passes.fuse_allreduce_rmsnorm import FuseAllReduceRMSNorm
from atomc.passes.noop_elimination import NoopElimination
from models.layers.norm import RMSNorm

HIDDEN = 32
norm = RMSNorm(HIDDEN, 1e-6)
torch.nn.init.normal_(norm.weight, generator=torch.Generator().manual_seed(0))


def _all_reduce(x):
    return torch.ops.atomc.all_reduce(x, "tp")


@pytest.fixture
def one_rank(tmp_path):
    """Tracing runs the function once: a world of one rank (gloo) lets its all-reduce run."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'one'}", rank=0, world_size=1)
    collective.set_group("tp", None)
    yield
    collective.clear_groups()
    dist.destroy_process_group()


def row_parallel_block(x, r):
    """A layer's end at TP > 1: the partial sum reduced, added to the residual stream, normalised."""
    h = r + _all_reduce(x)
    return norm(h), h * 3  # the residual stream goes on from h


def reduced_read_twice(x, r):
    p = _all_reduce(x)
    h = p + r
    return norm(h), p * 2  # the reduced sum has a reader of its own: it must stay


def local_residual_block(x, r):
    h = x + r
    return norm(h), h


def fused_add(fn, x=None, r=None):
    """(graph as traced, its inputs, graph after the add + norm fusion)."""
    x = torch.randn(5, HIDDEN) if x is None else x
    gm, inputs = capture(fn, x, torch.randn_like(x) if r is None else r)
    after = gm
    for p in (NoopElimination(), Canonicalize(), FuseAddRMSNorm()):
        _, after = apply(p, after)
    return gm, inputs, after


def test_all_reduce_add_and_norm_become_one_op(one_rank):
    gm, _, fused = fused_add(row_parallel_block)
    canon = gm
    for p in (NoopElimination(), Canonicalize()):
        _, canon = apply(p, canon)
    assert [ops(canon)[op] for op in ("atomc.all_reduce", "add", "atomc.rms_norm")] == [1, 1, 1]
    assert ops(fused)["atomc.fused_add_rms_norm"] == 1 and ops(fused)["atomc.all_reduce"] == 1
    result, after = apply(FuseAllReduceRMSNorm(), fused)
    assert (result.matched, result.rewritten, result.notes) == (1, 1, "")
    counts = ops(after)
    assert counts["atomc.all_reduce_add_rms_norm"] == 1
    assert [counts[op] for op in ("atomc.all_reduce", "add", "atomc.rms_norm", "atomc.fused_add_rms_norm")] == [0] * 4
    (node,) = [n for n in after.graph.nodes if n.target is torch.ops.atomc.all_reduce_add_rms_norm.default]
    assert node.args[-1] == "tp"  # the all-reduce's group goes with it
    assert all(isinstance(v, torch.Tensor) for v in node.meta["example_value"])  # later passes match on it


def test_declined_when_the_reduced_sum_has_another_reader(one_rank):
    _, _, fused = fused_add(reduced_read_twice)
    result, after = apply(FuseAllReduceRMSNorm(), fused)
    assert (result.matched, result.rewritten) == (1, 0) and "kept apart" in result.notes
    assert ops(after)["atomc.all_reduce"] == 1 and ops(after)["atomc.all_reduce_add_rms_norm"] == 0


def test_no_all_reduce_no_match(one_rank):
    _, _, fused = fused_add(local_residual_block)
    result, after = apply(FuseAllReduceRMSNorm(), fused)
    assert (result.matched, result.rewritten) == (0, 0)
    assert ops(after)["atomc.fused_add_rms_norm"] == 1


def test_joins_the_pipeline_only_at_tensor_parallel_size_above_one():
    one, two = PassManager.for_platform("cpu"), PassManager.for_platform("cuda", tensor_parallel_size=2)
    assert "fuse_allreduce_rmsnorm" not in one.names
    i = two.names.index("fuse_allreduce_rmsnorm")
    assert two.names[i - 1] == "fuse_rmsnorm_fp8_quant" and "fuse_add_rmsnorm" in two.names[:i]
    assert dict(two.uuids())["fuse_allreduce_rmsnorm"] == FuseAllReduceRMSNorm().uuid()
    # one --disable-pass list serves every size
    assert PassManager.for_platform("cpu", disabled=["fuse_allreduce_rmsnorm"]).names == one.names
    off = PassManager.for_platform("cpu", disabled=["fuse_allreduce_rmsnorm"], tensor_parallel_size=2)
    assert off.names == one.names


# ---- numbers: two gloo ranks ----


def _partial(rank: int, tokens: int) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(100 + rank))


def _rank(rank: int, size: int, init: str, out) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        collective.set_group("tp", None)
        x, r = _partial(rank, 7), torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(7))
        gm, inputs, fused = fused_add(row_parallel_block, x, r)
        result, after = apply(FuseAllReduceRMSNorm(), fused)
        assert result.rewritten == 1
        w = norm.weight.detach()
        op = torch.ops.atomc.all_reduce_add_rms_norm(x, r, w, 1e-6, "tp")
        pair = torch.ops.atomc.fused_add_rms_norm(torch.ops.atomc.all_reduce(x, "tp"), r, w, 1e-6)
        graphs = run(gm, inputs), run(after, inputs)  # the graph as traced, and fused
        torch.save({"op": op, "pair": pair, "graphs": graphs}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_two_ranks_fused_matches_unfused(tmp_path):
    out = tmp_path / "result"
    mp.start_processes(_rank, args=(2, f"file://{tmp_path / 'rendezvous'}", out), nprocs=2, start_method="spawn")
    r = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():  # what the ranks should hold: computed here, without any collective
        want = norm(_partial(0, 7) + _partial(1, 7) + r), _partial(0, 7) + _partial(1, 7) + r
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        assert_same(got["op"], got["pair"])  # the reference body is the pair, bit for bit
        assert_same(got["graphs"][0], got["graphs"][1])
        assert_same(got["op"], want, atol=1e-5, rtol=1e-5)
        assert_same(got["graphs"][1][1], want[1] * 3, atol=1e-5, rtol=1e-5)


# ---- a tensor-parallel model: two gloo ranks, each tracing its shard through the TP pipeline ----

PROMPT = [5, 17, 101, 3, 250, 42, 7, 99, 311]


def _model_rank(rank: int, size: int, init: str, path, expert_parallel: bool, out) -> None:
    from models.layers.parallel import ParallelInfo
    from models.loader import load_model

    torch.set_num_threads(1)  # the ranks share the cores
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
    try:
        collective.set_group("tp", None)
        model = load_model(
            path, torch.float32, "cpu", parallel=ParallelInfo(rank, size, expert_parallel=expert_parallel)
        )
        pm = PassManager.for_platform("cpu", tensor_parallel_size=size)
        reports = []

        def backend(gm, example_inputs):
            reports[:] = pm.run(gm)  # Dynamo may restart once: keep the last run
            return gm

        compiled = torch.compile(model.forward, backend=backend, fullgraph=True, dynamic=True)
        ids, positions = torch.tensor(PROMPT), torch.arange(len(PROMPT))
        with torch.no_grad():
            eager = model.compute_logits(model(ids, positions))
            got = model.compute_logits(compiled(ids, positions))
        counts = {r.name: (r.matched, r.rewritten) for r in reports}
        torch.save({"eager": eager, "got": got, "counts": counts, "code": reports[-1].graph_after}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


# family: (expert parallel, fused a rank, all-reduces left a rank)
MODELS = {
    "llama": (False, 4, 1),  # 2 layers: o_proj and down_proj each; the embedding's is left
    "qwen3_moe": (True, 4, 1),  # expert-parallel MoE blocks reduce their experts' sum the same way
    # 3 layers, every layer end fused: a MoE layer adds its routed and shared experts' partial
    # sums and reduces them once (models/deepseek.py), so that one all-reduce meets the add + norm
    "deepseek_v3": (True, 6, 1),
}


@pytest.mark.parametrize(
    "family",
    ["llama", pytest.param("qwen3_moe", marks=pytest.mark.slow), pytest.param("deepseek_v3", marks=pytest.mark.slow)],
)
def test_two_rank_model_fuses_every_layer_end_and_keeps_its_logits(checkpoints, tmp_path, family):
    """At TP 2 the all-reduces of o_proj and of the MLP or MoE block are fused with the add and the
    next norm (the last one with the final norm); the embedding's, which the first norm and the
    residual both read, stays (MODELS says what else stays). Logits: the eager TP model's, and one
    process's."""
    from models.loader import load_model

    expert_parallel, fused, left = MODELS[family]
    whole = load_model(checkpoints[family], torch.float32, "cpu")
    with torch.no_grad():
        want = whole.compute_logits(whole(torch.tensor(PROMPT), torch.arange(len(PROMPT))))
    out, init = tmp_path / "rank", f"file://{tmp_path / 'rendezvous'}"
    args = (2, init, checkpoints[family], expert_parallel, out)
    mp.start_processes(_model_rank, args=args, nprocs=2, start_method="spawn")
    for rank in range(2):
        got = torch.load(f"{out}.{rank}")
        assert got["counts"]["fuse_allreduce_rmsnorm"] == (fused, fused)
        code = got["code"]
        assert code.count("torch.ops.atomc.all_reduce_add_rms_norm.default(") == fused
        assert code.count("torch.ops.atomc.all_reduce.default(") == left
        torch.testing.assert_close(got["got"], got["eager"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["got"], want, atol=1e-4, rtol=1e-4)
