"""The compile report's FLOP accounting on traced tiny models: MoE nodes listed with their sizes
and counted by their active experts (T*top_k), the shares in atomc kernels and in rewritten ones."""

from __future__ import annotations

import torch

from atomc.graphs.report import format_report, graph_flops
from atomc.passes import PassManager
from models.loader import load_model


def traced_flops(path) -> tuple[dict, dict]:
    """(flops as traced, flops after the CPU passes) of the model's forward graph."""
    model = load_model(path, torch.float32, "cpu")
    seen = {}

    def backend(gm, example_inputs):
        seen["before"] = graph_flops(gm)
        PassManager.for_platform("cpu").run(gm)
        seen["after"] = graph_flops(gm, baseline=seen["before"])
        return gm

    compiled = torch.compile(model.forward, backend=backend, fullgraph=True, dynamic=True)
    with torch.no_grad():
        compiled(torch.arange(9), torch.arange(9))
    return seen["before"], seen["after"]


def manifest(flops: dict) -> dict:
    return {"key": "k", "format": "aot_fn", "passes": [], "partitions": [], "flops": flops, "timings": {}}


def test_moe_nodes_are_listed_and_counted_by_their_active_experts(checkpoints):
    before, after = traced_flops(checkpoints["qwen3_moe"])  # 2 layers, 8 experts, top-2, H 64, I 48
    per_block = 2 * 2 * (2 * 48 * 64 + 64 * 48)  # k experts a token: gate/up then down, not all 8
    assert [(m["experts"], m["top_k"], m["hidden"], m["intermediate"]) for m in after["moe_nodes"]] == [
        (8, 2, 64, 48)
    ] * 2
    assert all(m["flops_per_token"] == per_block and m["op"] == "atomc::moe" for m in after["moe_nodes"])
    assert before["by_op"]["atomc::moe"] == after["by_op"]["atomc::moe"] == 2 * per_block
    # the model called atomc::moe itself: in atomc kernels, not rewritten by a pass; every other
    # atomc op left after the passes (norms, RoPE + KV write, paged attention) was a pass's rewrite
    assert after["atomc_per_token"] - after["rewritten_per_token"] == 2 * per_block
    assert after["rewritten_per_token"] > 0 and after["atomc_share"] > after["rewritten_share"]
    # MoE blocks dominate this model's FLOPs after attention, so most FLOPs run in atomc kernels
    assert after["atomc_share"] > 0.5
    text = format_report(manifest(after))
    assert f"{after['atomc_share']:.1%} of per-token FLOPs in atomc kernels" in text
    assert "moe        2 nodes" in text and text.count("8 experts, top-2, hidden 64, intermediate 48") == 2


def test_shared_experts_inside_the_op_count_as_active(checkpoints, monkeypatch):
    """DeepSeek-V2 with its two shared experts inside the MoE op (FUSE_SHARED_EXPERTS): the node
    lists the routed experts and the shared ones apart, and counts every token through both."""
    from models import deepseek

    monkeypatch.setattr(deepseek, "FUSE_SHARED_EXPERTS", True)
    _, after = traced_flops(checkpoints["deepseek_v2"])  # 8 experts, top-2, 2 shared, H 64, I 32
    per_block = 2 * (2 + 2) * (2 * 32 * 64 + 64 * 32)
    assert [(m["experts"], m["top_k"], m.get("shared_experts")) for m in after["moe_nodes"]] == [(8, 2, 2)] * 2
    assert all(m["flops_per_token"] == per_block for m in after["moe_nodes"])
    assert format_report(manifest(after)).count("8 experts, top-2, hidden 64, intermediate 32, 2 shared") == 2


def test_dense_models_have_no_moe_nodes(checkpoints):
    before, after = traced_flops(checkpoints["llama"])
    assert after["moe_nodes"] == [] and "atomc::moe" not in after["atomc_ops"]
    # llama's only atomc op as traced is attention, which the passes replace: all atomc FLOPs are rewritten
    assert before["atomc_ops"] == ["atomc::attention"]
    assert after["atomc_per_token"] == after["rewritten_per_token"] > 0
    assert "moe " not in format_report(manifest(after))
    # bf16 linears: counted, none in FP8 GEMMs, and no fp8 line in the report
    assert after["linear_per_token"] > 0 and after["fp8_linear_share"] == 0.0
    assert "fp8 " not in format_report(manifest(after))


def test_sparse_layers_only_are_moe_nodes(checkpoints, tmp_path):
    from tests.conftest import FAMILIES, build_checkpoint

    spec = dict(FAMILIES["qwen3_moe"], decoder_sparse_step=2)
    FAMILIES["qwen3_moe_step2"] = spec
    try:
        path = build_checkpoint("qwen3_moe_step2", tmp_path / "m", num_layers=4)
    finally:
        del FAMILIES["qwen3_moe_step2"]
    _, after = traced_flops(path)
    assert len(after["moe_nodes"]) == 2  # layers 1 and 3


def test_deepseek_report_lists_the_fused_latent_op(checkpoints):
    """The MLA layers' fused latent norm + RoPE shows in the report: the pass's row, and the op among
    the atomc kernels (a pass's rewrite: not in the graph as traced)."""
    model = load_model(checkpoints["deepseek_v3"], torch.float32, "cpu")
    seen = {}

    def backend(gm, example_inputs):
        seen["before"] = graph_flops(gm)
        seen["reports"] = PassManager.for_platform("cpu").run(gm)
        seen["after"] = graph_flops(gm, baseline=seen["before"])
        return gm

    with torch.no_grad():
        torch.compile(model.forward, backend=backend, fullgraph=True, dynamic=True)(torch.arange(9), torch.arange(9))
    assert "atomc::mla_latent_norm_rope" in seen["after"]["atomc_ops"]
    assert "atomc::mla_latent_norm_rope" not in seen["before"]["atomc_ops"]
    assert seen["after"]["by_op"]["atomc::mla_latent_norm_rope"] > 0
    passes = [{"name": r.name, "matched": r.matched, "rewritten": r.rewritten, "seconds": 0.0} for r in seen["reports"]]
    text = format_report({**manifest(seen["after"]), "passes": passes})
    layers = model.arch.num_layers
    assert f"fuse_mla_latent_norm_rope {layers:>7}  {layers:>9}" in text
