"""The kernel registry's one list of context-reading ops is complete and exact, and those ops'
hidden effects are declared to FX."""

from __future__ import annotations

import importlib
import pkgutil
import types

import pytest
import torch
from torch._library.custom_ops import CustomOpDef

import atomc.ops
from atomc import forward_context
from atomc.kernels import registry

READERS = (forward_context.layer_cache,)  # the one accessor of the per-step context


def _names(code: types.CodeType) -> set[str]:
    out = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= _names(c)
    return out


def reads_context(fn, seen=None) -> bool:
    """Whether fn (an op body) reaches the forward context, through any atomc function it calls."""
    seen = set() if seen is None else seen
    fn = fn._init_fn if isinstance(fn, CustomOpDef) else fn
    if not isinstance(fn, types.FunctionType) or fn in seen:
        return False
    seen.add(fn)
    for name in _names(fn.__code__):
        obj = fn.__globals__.get(name)
        if obj is forward_context or any(obj is r for r in READERS):
            return True
        if isinstance(obj, (types.FunctionType, CustomOpDef)) and reads_context(obj, seen):
            return True
    return False


def atomc_op_bodies() -> dict[str, object]:
    """Every op defined in atomc/ops (found by walking the package, so a new op is found too)."""
    out = {}
    for info in pkgutil.iter_modules(atomc.ops.__path__):
        module = importlib.import_module(f"atomc.ops.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, CustomOpDef) and obj._namespace == "atomc":
                out[obj._name] = obj
    return out


def _reads_the_cache():
    return forward_context.layer_cache(0)


def _calls_a_reader():
    return _reads_the_cache()


def test_reads_context_sees_through_calls():
    assert reads_context(_calls_a_reader) and not reads_context(lambda: 1)


def test_context_ops_are_exactly_the_ops_that_read_the_forward_context():
    bodies = atomc_op_bodies()
    assert set(registry.OPS) == set(bodies), "every atomc op is listed in registry.OPS"
    readers = {name for name, body in bodies.items() if reads_context(body)}
    assert readers == set(registry.CONTEXT_OPS), (
        f"ops reading the forward context {sorted(readers)} != registry.CONTEXT_OPS {sorted(registry.CONTEXT_OPS)}"
    )


@pytest.mark.parametrize("backend", ["triton", "aiter"])
def test_backend_bodies_read_the_context_only_where_listed(backend):
    if backend == "triton" and not registry.backend_available("triton"):
        pytest.skip("triton is not installed")
    modules = [importlib.import_module(m) for m in registry.MODULES[backend]]
    for op in {op for op, b in registry.entries() if b == backend}:
        (body,) = [getattr(m, op) for m in modules if callable(getattr(m, op, None))]
        assert reads_context(body) == (op in registry.CONTEXT_OPS), f"{backend}::{op}"


def test_splitting_ops_name_only_ops_that_exist():
    names = registry.splitting_op_names()
    assert "atomc::all_reduce" not in names
    for name in names:
        ns, _, op = name.partition("::")
        assert op in registry.CONTEXT_OPS and ns in registry.NAMESPACES.values()
    for op in registry.CONTEXT_OPS:
        assert hasattr(torch.ops.atomc, op), op


def test_kv_writing_ops_survive_fx_dead_code_elimination():
    """rope_and_write_kv's schema is functional but it writes the KV cache: with its outputs unused,
    FX's DCE must still keep it (registry marks it side-effectful)."""
    g = torch.fx.Graph()
    pos, q, k, v, cs = (g.placeholder(n) for n in ("pos", "q", "k", "v", "cs"))
    g.call_function(torch.ops.atomc.rope_and_write_kv.default, (pos, q, k, v, cs, 0))
    g.call_function(torch.ops.atomc.rope.default, (pos, q, k, cs))  # pure: removed
    g.output(None)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    gm.graph.eliminate_dead_code()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.atomc.rope_and_write_kv.default]


def test_chosen_modules_follow_the_platform():
    assert registry.chosen_modules("cpu") == ["atomc.ops"]
    if registry.backend_available("triton"):
        assert "atomc.kernels.triton.ops" in registry.chosen_modules("cuda")


def test_a_triton_binding_that_strays_from_the_atomc_schema_is_refused():
    import atomc.kernels.triton.ops as triton_ops

    def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # eps missing
        return x

    with pytest.raises(TypeError, match="atomc::rms_norm is"):
        triton_ops.custom("rms_norm")(rms_norm)
    # a body taking *args gets the atomc op's schema as it is
    triton_schema = str(torch.ops.atomc_triton.moe.default._schema)
    assert triton_schema.replace("atomc_triton::", "atomc::", 1) == str(torch.ops.atomc.moe.default._schema)
