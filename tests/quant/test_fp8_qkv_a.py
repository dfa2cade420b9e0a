"""The FP8 linear methods on DeepSeek's qkv_a_proj layout (models/deepseek.py): a q section (q_a_proj,
or q_proj split by heads under TP) then a replicated kv_a section whose rows end inside a block
(576 = 4.5 blocks of 128 in the real checkpoints; 200 here). Each section loads through its shard id
with its own scales, and the merged GEMM gives what the two linears give apart."""

from __future__ import annotations

import pytest
import torch

from models.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, ReplicatedLinear
from models.layers.parallel import SINGLE, ParallelInfo
from models.quant.fp8 import FP8_DTYPE, method_for
from models.quant.spec import FP8Scheme, QuantConfigError

HIDDEN, Q, KV_A, BLOCK = 256, 256, 200, 128
SCHEMES = {
    "block": FP8Scheme("block", "group", (BLOCK, BLOCK)),
    "tensor-static": FP8Scheme("tensor", "static"),
    "channel-token": FP8Scheme("channel", "token"),
}
# (q section split across ranks, parallel): V3's q_a_proj is replicated, V2's q_proj split by heads
LAYOUTS = {
    "q_a": (False, SINGLE),
    "q_proj": (True, SINGLE),
    "q_proj-tp2-rank0": (True, ParallelInfo(0, 2)),
    "q_proj-tp2-rank1": (True, ParallelInfo(1, 2)),
}


def checkpoint(scheme: FP8Scheme, seed: int) -> dict[int, dict[str, torch.Tensor]]:
    """Per section (shard id 0: q, 1: kv_a): the tensors a checkpoint stores for that linear."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for sid, rows in enumerate((Q, KV_A)):
        t = {"weight": (torch.randn(rows, HIDDEN, generator=g) * 2).to(FP8_DTYPE)}
        if scheme.weight == "block":
            t["weight_scale_inv"] = torch.rand(-(-rows // BLOCK), HIDDEN // BLOCK, generator=g) / 100 + 1e-3
        elif scheme.weight == "tensor":
            t["weight_scale"] = torch.rand((), generator=g) / 100 + 1e-3
        else:
            t["weight_scale"] = torch.rand(rows, 1, generator=g) / 100 + 1e-3  # compressed-tensors' [N, 1]
        if scheme.activation == "static":
            t["input_scale"] = torch.tensor(0.02 + 0.01 * sid)  # calibrated apart: the max serves both
        out[sid] = t
    return out


def load(layer, tensors: dict[str, torch.Tensor], shard_id=None):
    params = dict(layer.named_parameters())
    for name, t in tensors.items():
        params[name].weight_loader(params[name], t, shard_id)
    layer.linear_method.process_weights_after_loading(layer)
    return layer


def local_rows(t: torch.Tensor, split: bool, parallel: ParallelInfo) -> torch.Tensor:
    n = t.shape[0] // parallel.size if split else t.shape[0]
    start = parallel.rank * n if split else 0
    return t[start : start + n]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", list(SCHEMES))
def test_merged_sections_keep_their_scales_and_give_the_linears_apart(kind, layout):
    scheme, (split_q, parallel) = SCHEMES[kind], LAYOUTS[layout]
    ckpt = checkpoint(scheme, seed=len(kind) + len(layout))
    merged = MergedColumnParallelLinear(
        HIDDEN, [Q, KV_A], False, parallel, method_for(scheme), replicated=(not split_q, True)
    )
    params = dict(merged.named_parameters())
    for sid in (0, 1):
        for name, t in ckpt[sid].items():
            params[name].weight_loader(params[name], t, sid)
    merged.linear_method.process_weights_after_loading(merged)

    q_layer = (ColumnParallelLinear if split_q else ReplicatedLinear)(HIDDEN, Q, False, parallel, method_for(scheme))
    kv_layer = ReplicatedLinear(HIDDEN, KV_A, False, parallel, method_for(scheme))
    load(q_layer, ckpt[0])
    load(kv_layer, ckpt[1])
    q_rows = Q // parallel.size if split_q else Q
    assert merged.local_output_sizes == [q_rows, KV_A]
    want_w = torch.cat([local_rows(ckpt[0]["weight"], split_q, parallel), ckpt[1]["weight"]])
    assert torch.equal(merged.weight.view(torch.uint8), want_w.view(torch.uint8))
    if scheme.weight == "block":  # q's whole blocks, then kv_a's 2 block rows (the second one partial)
        q_scale = local_rows(ckpt[0]["weight_scale_inv"], split_q, parallel)
        assert torch.equal(merged.weight_scale_inv, torch.cat([q_scale, ckpt[1]["weight_scale_inv"]]))
        assert merged.weight_scale_inv.shape[0] == q_rows // BLOCK + 2
    else:  # per row after loading: each section's own scale (per-tensor: repeated over its rows)
        assert torch.equal(
            merged.weight_scale, torch.cat([q_layer.weight_scale.expand(q_rows), kv_layer.weight_scale.expand(KV_A)])
        )
    if scheme.activation == "static":
        assert merged.input_scale.tolist() == [pytest.approx(0.03)]
        q_layer.input_scale.data.fill_(0.03)  # the one input: both sections quantise it with the max
        kv_layer.input_scale.data.fill_(0.03)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))
    out = merged(x)
    q, kv_a = out.split([q_rows, KV_A], dim=-1)
    torch.testing.assert_close(q, q_layer(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv_a, kv_layer(x), atol=1e-5, rtol=1e-5)


def test_block_fp8_refuses_a_section_that_ends_inside_a_block_before_another():
    """kv_a first would put q's rows inside kv_a's last block: refused with the reason, not misread."""
    with pytest.raises(QuantConfigError, match=r"section 0 of .* 200 rows .* another section starts after it"):
        MergedColumnParallelLinear(
            HIDDEN, [KV_A, Q], linear_method=method_for(SCHEMES["block"]), replicated=(True, True)
        )


def test_block_fp8_refuses_a_split_section_of_partial_blocks():
    with pytest.raises(QuantConfigError, match=r"section 0 of .* 64 rows on this rank.*split across ranks"):
        MergedColumnParallelLinear(
            HIDDEN, [128, KV_A], False, ParallelInfo(0, 2), method_for(SCHEMES["block"]), replicated=(False, True)
        )
