import pytest
import torch
from pass_helpers import apply, assert_same, decoder_graph, ops, run, through

from atomc.kernels import registry
from atomc.passes.canonicalize import Canonicalize
from atomc.passes.fuse_add_rmsnorm import FuseAddRMSNorm
from atomc.passes.fuse_rope_kv_write import FuseRopeKVWrite
from atomc.passes.fuse_silu_mul import FuseSiluMul
from atomc.passes.lowering import Lowering
from atomc.passes.noop_elimination import NoopElimination
from tests.kernels import fake_aiter

FUSED = (NoopElimination(), Canonicalize(), FuseAddRMSNorm(), FuseSiluMul(), FuseRopeKVWrite())


@pytest.fixture(scope="module")
def fused():
    gm, inputs = decoder_graph()
    return gm, inputs, through(gm, *FUSED)


def namespaces(gm) -> dict[str, str]:
    return {k.split(".", 1)[1]: k.split(".", 1)[0] for k in ops(gm) if k.startswith("atomc")}


def test_cpu_keeps_reference_ops(fused):
    gm, inputs, before = fused
    result, after = apply(Lowering("cpu"), before)
    # rms_norm, 2 fused_add_rms_norm, silu_and_mul, rope_and_write_kv, paged_attention
    assert (result.matched, result.rewritten) == (6, 0)
    assert set(namespaces(after).values()) == {"atomc"}
    assert_same(run(gm, inputs), run(after, inputs))


def test_cuda_uses_triton(fused):
    _, inputs, before = fused
    result, after = apply(Lowering("cuda"), before)
    assert result.rewritten == 6
    assert set(namespaces(after).values()) == {"atomc_triton"}
    if torch.cuda.is_available():  # the kernels need a GPU (or TRITON_INTERPRET) to run
        cuda = [x.cuda() if isinstance(x, torch.Tensor) else x for x in inputs]
        assert_same(run(before.cuda(), cuda), run(after.cuda(), cuda), atol=2e-5, rtol=2e-5)


def test_rocm_prefers_aiter_then_triton(fused, monkeypatch):
    gm, inputs, before = fused
    fake_aiter.install(monkeypatch)
    monkeypatch.setattr(registry, "backend_available", lambda backend: True)
    result, after = apply(Lowering("rocm"), before)
    assert result.rewritten == 6
    ns = namespaces(after)
    ops_ = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rope_and_write_kv", "paged_attention")
    assert {ns[op] for op in ops_} == {"atomc_aiter"}
    # runs on CPU: the stand-in computes AITER's ops, paged attention takes its no-cache path
    assert_same(run(gm, inputs), run(after, inputs), atol=1e-5, rtol=1e-5)


def test_registry_covers_every_op_and_names_cut_points():
    assert {op for op, b in registry.entries() if b == "torch"} == set(registry.OPS)
    assert all(b == "torch" for b in (s.split(":")[1] for s in registry.ensure_registered("cpu")))
    assert {"atomc::attention", "atomc::paged_attention", "atomc::rope_and_write_kv"} <= set(
        registry.splitting_op_names()
    )
    with pytest.raises(ValueError, match="valid: cpu, cuda, rocm"):
        Lowering("tpu")


def windowed_attention_graph(window):
    """atomc.rope + atomc.attention of one fp16 Llama attention layer with a sliding window, fused."""
    from pass_helpers import arch, attention, capture

    from models.layers.rotary import RotaryEmbedding

    a = arch(sliding_window=window)
    torch.manual_seed(0)
    attn, rope = attention(a).half(), RotaryEmbedding(a.head_dim, 64, 10000.0, None)
    gm, inputs = capture(lambda p, x: attn(p, x, rope), torch.arange(5), torch.randn(5, a.hidden_size).half())
    return a, through(gm, *FUSED), inputs


def windows_of(gm) -> dict[str, int]:
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and "attention" in str(n.target)]
    return {str(n.target): n.args[6] for n in nodes}


def test_sliding_window_survives_lowering(monkeypatch):
    """The window stays on the attention node through the lowering, and the ROCm graph (AITER stand-in)
    computes what the reference graph does over a 6-token prefill and a decode step (window 3), with
    the KV cache in one 128-token page (CK's paged prefill needs pages of a multiple of 128)."""
    from atomc.forward_context import AttentionMetadata, ForwardContext, set_forward_context

    a, before, inputs = windowed_attention_graph(3)
    assert windows_of(before) == {"atomc.paged_attention.default": 3}
    fake_aiter.install(monkeypatch)
    monkeypatch.setattr(registry, "backend_available", lambda backend: True)
    assert windows_of(apply(Lowering("cuda"), before)[1]) == {"atomc_triton.paged_attention.default": 3}
    _, after = apply(Lowering("rocm"), before)
    assert windows_of(after) == {"atomc_aiter.paged_attention.default": 3}
    caches = {g: (torch.zeros(1, 128, 2, 16).half(), torch.zeros(1, 128, 2, 16).half()) for g in ("ref", "aiter")}
    x = torch.randn(7, a.hidden_size).half()
    fake_aiter.CALLS.clear()
    for start, n in ((0, 6), (6, 1)):
        meta = AttentionMetadata(
            torch.arange(start, start + n), torch.tensor([0, n], dtype=torch.int32),
            torch.tensor([start + n], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
            [0, n], [start + n], n, start + n, 1,
        )  # fmt: skip
        step = [torch.arange(start, start + n) if isinstance(v, torch.Tensor) and v.dtype == torch.int64
                else x[start : start + n] if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[0] == 5
                else n if isinstance(v, int) and v == 5 else v for v in inputs]  # fmt: skip
        outs = {}
        for name, g in (("ref", before), ("aiter", after)):
            with set_forward_context(ForwardContext(meta, [caches[name]])):
                outs[name] = run(g, step)
        assert_same(outs["ref"], outs["aiter"], atol=2e-3, rtol=2e-3)
    assert_same(caches["ref"], caches["aiter"])
    assert fake_aiter.CALLS.count("flash_attn_varlen_func") == 1 and fake_aiter.CALLS.count("paged_attention_v1") == 1
