"""The whole default CPU pipeline on traced tiny checkpoints: what each pass rewrites, logits unchanged."""

import pytest
import torch

from atomc.passes import PassManager
from models.loader import load_model

# (matched, rewritten) per pass for a 2-layer model, fp32 (q/k/v and gate/up are merged by the loader)
EXPECTED = {
    "llama": {
        "noop_elimination": (12, 12),  # fp32 casts: 2 per norm x 5 norms + 1 per RoPE table x 2
        "canonicalize": (19, 9),  # 8 linears (counted), 5 norms, 2 silu*mul, 2 ropes, 2 attention (counted)
        "fuse_add_rmsnorm": (4, 4),
        "fuse_silu_mul": (2, 2),
        "share_fp8_quant": (0, 0),  # no FP8 linears (the FP8 pipeline: tests/quant/test_fp8_models.py)
        "fuse_rmsnorm_fp8_quant": (0, 0),
        "fuse_silu_mul_fp8_quant": (0, 0),
        "fuse_fp8_quant_linear": (0, 0),
        "fuse_rope_kv_write": (2, 2),
        "fuse_qk_norm_rope": (2, 0),  # no q/k norms
        "fuse_mla_latent_norm_rope": (0, 0),  # no latent attention (DeepSeek's: test_fuse_mla_latent_norm_rope.py)
        "decode_gemv": (8, 0),  # cpu keeps F.linear
        "lowering": (11, 0),  # cpu: 1 rms_norm, 4 fused_add, 2 silu_and_mul, 2 rope_kv, 2 paged stay
    },
    "qwen3": {  # + q_norm/k_norm per layer
        "noop_elimination": (20, 20),
        "canonicalize": (23, 13),
        "fuse_add_rmsnorm": (4, 4),
        "fuse_silu_mul": (2, 2),
        "share_fp8_quant": (0, 0),
        "fuse_rmsnorm_fp8_quant": (0, 0),
        "fuse_silu_mul_fp8_quant": (0, 0),
        "fuse_fp8_quant_linear": (0, 0),
        "fuse_rope_kv_write": (2, 2),
        "fuse_qk_norm_rope": (2, 2),  # 4 q/k norms folded into the 2 rope + KV writes
        "fuse_mla_latent_norm_rope": (0, 0),
        "decode_gemv": (8, 0),
        "lowering": (11, 0),
    },
}


@pytest.mark.parametrize("family", list(EXPECTED))
def test_default_cpu_pipeline_keeps_logits(checkpoints, family):
    model = load_model(checkpoints[family], torch.float32, "cpu")
    ids, positions = torch.randint(0, 300, (9,)), torch.arange(9)
    with torch.no_grad():
        ref = model.compute_logits(model(ids, positions))
    pm = PassManager.for_platform("cpu")
    # the loaded model already has one GEMM for q/k/v and one for gate/up per layer
    names = {n for n, _ in model.named_modules()}
    assert {"model.layers.1.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj"} <= names
    assert not {n.rsplit(".", 1)[-1] for n in names} & {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    reports = []

    def backend(gm, example_inputs):
        reports[:] = pm.run(gm)  # Dynamo may restart once: keep the last run
        return gm

    compiled = torch.compile(model.forward, backend=backend, fullgraph=True, dynamic=True)
    with torch.no_grad():
        got = model.compute_logits(compiled(ids, positions))
        got_short = model.compute_logits(compiled(ids[:4], positions[:4]))
        ref_short = model.compute_logits(model(ids[:4], positions[:4]))
    assert {r.name: (r.matched, r.rewritten) for r in reports} == EXPECTED[family]
    code = reports[-1].graph_after
    assert "torch.ops.atomc.attention" not in code and "torch.rsqrt" not in code
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_short, ref_short, atol=1e-5, rtol=1e-5)


def _one_sequence_context(start: int, n: int, caches, page: int = 16):
    from atomc.forward_context import AttentionMetadata, ForwardContext

    dev = caches[0][0].device
    blocks = list(range(caches[0][0].shape[0]))[::-1]  # pages in reverse order: exercises the block table
    slots = [blocks[p // page] * page + p % page for p in range(start, start + n)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=dev),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([start + n], dtype=torch.int32, device=dev),
        block_tables=torch.tensor([blocks], dtype=torch.int32, device=dev),
        query_start_loc_host=[0, n],
        seq_lens_host=[start + n],
        max_query_len=n,
        max_seq_len=start + n,
        num_seqs=1,
    )
    return ForwardContext(meta, caches)


def _lowered(pm):
    def backend(gm, example_inputs):
        pm.run(gm)
        return gm

    return backend


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pipeline_with_paged_cache(checkpoints):
    """Triton-lowered graph vs the eager model, both over a paged KV cache: prefill, then decode."""
    from atomc.forward_context import set_forward_context

    model = load_model(checkpoints["llama"], torch.float32, "cuda")
    pm = PassManager.for_platform("cuda")
    a = model.arch
    ids = torch.randint(0, 300, (21,), device="cuda")
    logits = {}
    with torch.no_grad():
        for name in ("eager", "compiled"):
            fn = model.forward
            if name == "compiled":
                fn = torch.compile(model.forward, backend=_lowered(pm), fullgraph=True, dynamic=True)
            shape = (2 * a.num_layers, 4, 16, a.num_kv_heads, a.head_dim)
            caches = list(zip(*torch.zeros(shape, device="cuda").chunk(2), strict=True))  # [(k, v)] per layer
            logits[name] = []
            for start, n in ((0, 20), (20, 1)):
                with set_forward_context(_one_sequence_context(start, n, caches)):
                    positions = torch.arange(start, start + n, device="cuda")
                    logits[name].append(model.compute_logits(fn(ids[start : start + n], positions)))
    for ref, got in zip(logits["eager"], logits["compiled"], strict=True):
        torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)
