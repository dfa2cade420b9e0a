import sys

from tests.kernels import fake_aiter
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
    monkeypatch.setitem(sys.modules, "aiter", fake_aiter.module())
    monkeypatch.setattr(registry, "backend_available", lambda backend: True)
    result, after = apply(Lowering("rocm"), before)
    assert result.rewritten == 6
    ns = namespaces(after)
    assert ns["paged_attention"] == "atomc_triton"  # no AITER attention wrapper yet
    assert {ns[op] for op in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rope_and_write_kv")} == {"atomc_aiter"}
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
