"""The layers load their own weights: merged q/k/v and gate/up sections equal the checkpoint's tensors,
and each tensor-parallel rank holds exactly its slice (loaded in one process: sharding is a pure
function of rank and size; no collective runs here)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from models.layers.parallel import ParallelInfo
from models.loader import load_model
from models.quant.base import LinearMethod, set_weight_attrs
from tests.passes.pass_helpers import capture, ops

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, VOCAB = 4, 2, 16, 64, 128, 384  # tests/conftest.py's shapes


def checkpoint(path):
    return load_file(str(path / "model.safetensors"))


def load(path, rank=0, size=1):
    return load_model(path, torch.float32, "cpu", parallel=ParallelInfo(rank, size))


def rows(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    n = t.shape[0] // size
    return t[rank * n : (rank + 1) * n]


def test_merged_sections_equal_the_checkpoint_with_biases(checkpoints):
    ckpt = checkpoint(checkpoints["qwen2"])  # qwen2: q/k/v carry biases
    model = load(checkpoints["qwen2"])
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    pre = "model.layers.1."
    for kind in ("weight", "bias"):
        q, k, v = getattr(attn.qkv_proj, kind).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM])
        assert torch.equal(q, ckpt[pre + f"self_attn.q_proj.{kind}"])
        assert torch.equal(k, ckpt[pre + f"self_attn.k_proj.{kind}"])
        assert torch.equal(v, ckpt[pre + f"self_attn.v_proj.{kind}"])
    assert attn.o_proj.bias is None and mlp.gate_up_proj.bias is None
    gate, up = mlp.gate_up_proj.weight.split([INTER, INTER])
    assert torch.equal(gate, ckpt[pre + "mlp.gate_proj.weight"]) and torch.equal(up, ckpt[pre + "mlp.up_proj.weight"])
    assert torch.equal(mlp.down_proj.weight, ckpt[pre + "mlp.down_proj.weight"])
    # tied embeddings: one Parameter, equal to the checkpoint's table
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, ckpt["model.embed_tokens.weight"])


@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_rank_holds_its_slices(checkpoints, rank):
    ckpt = checkpoint(checkpoints["qwen2"])
    model = load(checkpoints["qwen2"], rank, 2)
    pre = "model.layers.0."
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert (attn.num_heads, attn.num_kv_heads) == (HEADS // 2, KV_HEADS // 2)
    for kind in ("weight", "bias"):
        want = torch.cat([rows(ckpt[pre + f"self_attn.{p}_proj.{kind}"], rank, 2) for p in "qkv"])
        assert torch.equal(getattr(attn.qkv_proj, kind), want)
    half = HEADS * HEAD_DIM // 2
    assert torch.equal(attn.o_proj.weight, ckpt[pre + "self_attn.o_proj.weight"][:, rank * half : (rank + 1) * half])
    want = torch.cat([rows(ckpt[pre + f"mlp.{p}_proj.weight"], rank, 2) for p in ("gate", "up")])
    assert torch.equal(mlp.gate_up_proj.weight, want)
    i = INTER // 2
    assert torch.equal(mlp.down_proj.weight, ckpt[pre + "mlp.down_proj.weight"][:, rank * i : (rank + 1) * i])
    assert torch.equal(model.model.embed_tokens.weight, rows(ckpt["model.embed_tokens.weight"], rank, 2))
    # replicated: norms whole on every rank
    assert torch.equal(model.model.norm.weight, ckpt["model.norm.weight"])
    specs = model.kv_cache_specs()
    assert len(specs) == 2 and all((s.num_kv_heads, s.head_dim) == (1, HEAD_DIM) for s in specs)


def test_tp2_ranks_together_rebuild_the_tensor(checkpoints):
    ckpt = checkpoint(checkpoints["llama"])
    parts = [load(checkpoints["llama"], r, 2).model.layers[1].self_attn.qkv_proj.weight for r in (0, 1)]
    q, k, v = (HEADS * HEAD_DIM // 2, KV_HEADS * HEAD_DIM // 2, KV_HEADS * HEAD_DIM // 2)
    for i, p in enumerate("qkv"):
        start = [0, q, q + k][i]
        got = torch.cat([part[start : start + [q, k, v][i]] for part in parts])
        assert torch.equal(got, ckpt[f"model.layers.1.self_attn.{p}_proj.weight"])


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_kv_heads_are_replicated_when_fewer_than_ranks(checkpoints, rank):
    ckpt = checkpoint(checkpoints["llama"])
    attn = load(checkpoints["llama"], rank, 4).model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (1, 1)
    q, k, v = attn.qkv_proj.weight.split([HEAD_DIM] * 3)
    kv_head = rank // 2  # 2 KV heads over 4 ranks: head h on ranks 2h and 2h+1
    pre = "model.layers.0.self_attn."
    assert torch.equal(q, ckpt[pre + "q_proj.weight"][rank * HEAD_DIM : (rank + 1) * HEAD_DIM])
    assert torch.equal(k, ckpt[pre + "k_proj.weight"][kv_head * HEAD_DIM : (kv_head + 1) * HEAD_DIM])
    assert torch.equal(v, ckpt[pre + "v_proj.weight"][kv_head * HEAD_DIM : (kv_head + 1) * HEAD_DIM])


@pytest.mark.parametrize("rank", [0, 1])
def test_fused_checkpoint_tensors_are_cut_by_the_layer(checkpoints, rank):
    """Phi-3 stores qkv_proj and gate_up_proj fused: shard_id=None, the layer cuts sections, then ranks."""
    ckpt = checkpoint(checkpoints["phi3"])
    pre = "model.layers.0."
    assert pre + "self_attn.qkv_proj.weight" in ckpt and pre + "self_attn.q_proj.weight" not in ckpt
    full = load(checkpoints["phi3"]).model.layers[0]
    assert torch.equal(full.self_attn.qkv_proj.weight, ckpt[pre + "self_attn.qkv_proj.weight"])
    assert torch.equal(full.mlp.gate_up_proj.weight, ckpt[pre + "mlp.gate_up_proj.weight"])
    layer = load(checkpoints["phi3"], rank, 2).model.layers[0]
    sections = [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]
    q, k, v = ckpt[pre + "self_attn.qkv_proj.weight"].split(sections)
    assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat([rows(t, rank, 2) for t in (q, k, v)]))
    gate, up = ckpt[pre + "mlp.gate_up_proj.weight"].chunk(2)
    assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([rows(gate, rank, 2), rows(up, rank, 2)]))


def test_vocab_that_does_not_divide_is_padded_on_the_last_rank():
    from models.layers.embedding import VocabParallelEmbedding

    table = torch.randn(10, 4)
    parts = []
    for rank in range(3):
        emb = VocabParallelEmbedding(10, 4, ParallelInfo(rank, 3))
        emb.weight_loader(emb.weight, table)
        parts.append(emb.weight.data)
    assert all(p.shape == (4, 4) for p in parts)
    assert torch.equal(torch.cat(parts)[:10], table) and torch.count_nonzero(parts[2][2:]) == 0


def test_sharded_forward_outside_a_worker_is_a_clear_error(checkpoints):
    model = load(checkpoints["llama"], 1, 2)
    with pytest.raises(RuntimeError, match="collective group 'tp' is not set up"):
        model(torch.arange(3), torch.arange(3))


def test_shapes_that_do_not_divide_are_clear_errors():
    with pytest.raises(ValueError, match="attention heads = 3 does not divide across 2"):
        QKVParallelLinear(64, 16, 3, 1, parallel=ParallelInfo(0, 2))
    with pytest.raises(ValueError, match="3 KV heads cannot be replicated evenly over 4"):
        QKVParallelLinear(64, 16, 4, 3, parallel=ParallelInfo(0, 4))
    with pytest.raises(ValueError, match="rank 2 of size 2"):
        ParallelInfo(2, 2)
    with pytest.raises(ValueError, match="replicated has 1 flags for 2 sections"):
        MergedColumnParallelLinear(64, [16, 16], replicated=(True,))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_replicated_section_is_whole_on_every_rank(rank):
    """DeepSeek's qkv_a_proj without q LoRA: q_proj's rows split by rank, kv_a_proj_with_mqa whole."""
    layer = MergedColumnParallelLinear(6, [8, 5], True, ParallelInfo(rank, 2), replicated=(False, True))
    w, b = {0: torch.randn(8, 6), 1: torch.randn(5, 6)}, {0: torch.randn(8), 1: torch.randn(5)}
    for sid in (0, 1):
        layer.weight_loader(layer.weight, w[sid], sid)
        layer.weight_loader(layer.bias, b[sid], sid)
    assert layer.local_output_sizes == [4, 5]
    assert torch.equal(layer.weight, torch.cat([rows(w[0], rank, 2), w[1]]))
    assert torch.equal(layer.bias, torch.cat([rows(b[0], rank, 2), b[1]]))


def test_each_linear_shards_the_right_dimension():
    w, b = torch.randn(8, 6), torch.randn(8)
    for rank in (0, 1):
        p = ParallelInfo(rank, 2)
        col, row = ColumnParallelLinear(6, 8, True, p), RowParallelLinear(6, 8, True, p)
        rep = ReplicatedLinear(6, 8, True, p)
        for layer in (col, row, rep):
            layer.weight_loader(layer.weight, w)
            layer.weight_loader(layer.bias, b)
        assert torch.equal(col.weight, w[rank * 4 : rank * 4 + 4]) and torch.equal(col.bias, b[rank * 4 : rank * 4 + 4])
        assert torch.equal(row.weight, w[:, rank * 3 : rank * 3 + 3]) and torch.equal(row.bias, b)  # bias whole
        assert torch.equal(rep.weight, w) and torch.equal(rep.bias, b)


def test_shard_shape_errors_name_the_section():
    layer = MergedColumnParallelLinear(6, [4, 4])
    with pytest.raises(ValueError, match=r"dim 0 should be 4 \(shard 1\)"):
        layer.weight_loader(layer.weight, torch.randn(5, 6), 1)
    with pytest.raises(ValueError, match="shard id 2 is not one of"):
        layer.weight_loader(layer.weight, torch.randn(4, 6), 2)
    with pytest.raises(ValueError, match="should hold the sections"):
        layer.weight_loader(layer.weight, torch.randn(9, 6))  # fused, wrong total


class PerShardScaleMethod(LinearMethod):
    """A test stand-in for FP8: a weight plus one scale per logical shard (q, k, v each its own),
    loaded through the same weight_loader and shard ids, folded into the weight after loading."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader):
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition), requires_grad=False)
        set_weight_attrs(weight, {"output_dim": 0, "input_dim": 1, "weight_loader": weight_loader})
        scale = nn.Parameter(torch.empty(len(output_partition_sizes)), requires_grad=False)
        set_weight_attrs(scale, {"per_shard": True, "weight_loader": weight_loader})
        layer.register_parameter("weight", weight)
        layer.register_parameter("weight_scale", scale)

    def process_weights_after_loading(self, layer):
        sizes = torch.tensor(layer.local_output_sizes)
        layer.weight.data *= layer.weight_scale.repeat_interleave(sizes)[:, None]

    def apply(self, layer, x, bias):
        return F.linear(x, layer.weight, bias)


@pytest.mark.parametrize("rank", [0, 1])
def test_per_shard_scales_load_through_shard_ids(rank):
    layer = QKVParallelLinear(8, 2, 4, 2, parallel=ParallelInfo(rank, 2), linear_method=PerShardScaleMethod())
    ws = {"q": torch.randn(8, 8), "k": torch.randn(4, 8), "v": torch.randn(4, 8)}
    scales = {"q": 2.0, "k": 3.0, "v": 5.0}
    for sid in "qkv":
        layer.weight_loader(layer.weight, ws[sid], sid)
        layer.weight_loader(layer.weight_scale, torch.tensor(scales[sid]), sid)
    assert layer.weight_scale.tolist() == [2.0, 3.0, 5.0]
    layer.linear_method.process_weights_after_loading(layer)
    want = torch.cat([rows(ws[s], rank, 2) * scales[s] for s in "qkv"])
    torch.testing.assert_close(layer.weight.data, want)


def test_unquantized_apply_traces_to_one_f_linear():
    layer = MergedColumnParallelLinear(6, [4, 4], bias=True)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    gm, _ = capture(layer, torch.randn(3, 6))
    counts = ops(gm)
    assert counts["linear"] == 1 and sum(counts.values()) == 1
    torch.testing.assert_close(layer(torch.ones(1, 6)), F.linear(torch.ones(1, 6), layer.weight, layer.bias))


@pytest.mark.parametrize("rank", [0, 1])
def test_fused_and_per_section_loads_agree_with_biases(rank):
    p = ParallelInfo(rank, 2)
    fused, apart = QKVParallelLinear(8, 2, 4, 2, True, p), QKVParallelLinear(8, 2, 4, 2, True, p)
    w = {"q": torch.randn(8, 8), "k": torch.randn(4, 8), "v": torch.randn(4, 8)}
    b = {s: torch.randn(len(t)) for s, t in w.items()}
    fused.weight_loader(fused.weight, torch.cat(list(w.values())))
    fused.weight_loader(fused.bias, torch.cat(list(b.values())))
    for sid in "qkv":
        apart.weight_loader(apart.weight, w[sid], sid)
        apart.weight_loader(apart.bias, b[sid], sid)
    assert torch.equal(fused.weight, apart.weight) and torch.equal(fused.bias, apart.bias)
    assert torch.equal(fused.bias, torch.cat([rows(b[s], rank, 2) for s in "qkv"]))
