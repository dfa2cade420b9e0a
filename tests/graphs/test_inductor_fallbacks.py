"""Inductor gets an explicit fallback for each custom op before it lowers a graph
(`compat.register_inductor_fallbacks`), so it never builds its "Creating implicit fallback" log line.

torch 2.11 builds that line eagerly: `str()` of the op's arguments, and an IR node prints its inputs
recursively, once per path. The FP8 graph's first plain `fused_add_rms_norm` is the final norm, so
its arguments print the whole graph, exponentially many times in the layer count (Llama-3.1-8B's
32 layers never finished lowering on the H200). torch 2.13 (this machine's) formats the line lazily:
with Inductor's INFO logs on it pays exactly what 2.11 always pays, which is how the end-to-end test
sees the bug here (without the fix: 402 IR nodes printed for 2 layers, 1702 for 3).
"""

from __future__ import annotations

import io
import logging

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor import ir, lowering
from torch._library.utils import get_layout_constraint_tag

from atomc import compat
from atomc.graphs.trace import AtomcBackend, aot_trace, inductor_compile
from atomc.passes import PassManager
from models.loader import load_model
from tests.conftest import build_checkpoint

_LIB = torch.library.Library("atomc_fallback_test", "DEF")
_LIB.define("plain(Tensor x) -> Tensor")
_LIB.define("strided(Tensor x) -> Tensor", tags=[torch.Tag.needs_fixed_stride_order])
_LIB.define("off(Tensor x) -> Tensor")
for _name in ("plain", "strided", "off"):
    _LIB.impl(_name, lambda x: x * 2, "CompositeExplicitAutograd")
    torch.library.register_fake(f"atomc_fallback_test::{_name}", lib=_LIB)(torch.empty_like)


def _graph(*ops) -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    for op in ops:
        x = g.call_function(op, (x,))
    g.output(x)
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_custom_ops_get_the_fallback_inductor_would_make():
    plain, strided = torch.ops.atomc_fallback_test.plain.default, torch.ops.atomc_fallback_test.strided.default
    gm = _graph(torch.ops.aten.relu.default, plain, strided, plain)
    assert plain not in lowering.lowerings and strided not in lowering.lowerings
    assert compat.register_inductor_fallbacks(gm) == [str(plain), str(strided)]  # aten left to Inductor
    assert plain in lowering.lowerings and strided in lowering.lowerings
    for op in (plain, strided):  # the constraint of Inductor's implicit fallback (its graph.py)
        want = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
        assert lowering.maybe_layout_constraints(op) is want
    assert lowering.maybe_layout_constraints(strided) is lowering.constrain_to_fx_strides
    assert compat.register_inductor_fallbacks(gm) == []  # once per process, as Inductor's own


def test_no_fallback_where_inductor_would_refuse_the_op():
    off = torch.ops.atomc_fallback_test.off.default
    with inductor_config.patch(implicit_fallbacks=False):
        assert compat.register_inductor_fallbacks(_graph(off)) == []
    assert off not in lowering.lowerings


@pytest.fixture
def inductor_info_log():
    """Inductor's graph logger at INFO into a formatting handler (torch 2.13 then formats the
    implicit-fallback line, as 2.11 always does); yields the text it wrote."""
    log, out = logging.getLogger("torch._inductor.graph"), io.StringIO()
    handler, old = logging.StreamHandler(out), (log.level, log.propagate)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    yield out
    log.removeHandler(handler)
    log.setLevel(old[0])
    log.propagate = old[1]


def test_fp8_cuda_graph_lowers_without_printing_ir(tmp_path, monkeypatch, inductor_info_log):
    """A 2-layer online-FP8 Llama through the CUDA passes (atomc_triton ops, fused FP8 norms), lowered
    by Inductor on the CPU as the engine does (trace.inductor_compile): no IR node is ever printed."""
    printed: list[str] = []
    original = ir.ExternKernel.__str__

    def counting_str(self):
        printed.append(type(self).__name__)
        if len(printed) > 10_000:  # the unfixed cost grows exponentially with layers: fail, not hang
            raise RecursionError("IR printed over 10000 times")
        return original(self)

    monkeypatch.setattr(ir.ExternKernel, "__str__", counting_str)
    monkeypatch.setattr(ir.ExternKernel, "__repr__", counting_str)
    model = load_model(build_checkpoint("llama", tmp_path / "ck"), torch.bfloat16, "cpu", quantization="fp8")

    def fresh_inductor_compile(gm, example_inputs, splitting_ops):
        # as in a fresh process: no lowering yet for the graph's custom ops (an earlier test's compile
        # may have made Inductor's implicit ones); monkeypatch puts them back afterwards
        for node in gm.graph.nodes:
            if isinstance(node.target, torch._ops.OpOverload) and node.target.namespace.startswith("atomc"):
                monkeypatch.delitem(lowering.lowerings, node.target, raising=False)
        return inductor_compile(gm, example_inputs, splitting_ops)

    backend = AtomcBackend(PassManager.for_platform("cuda"), compile_fn=fresh_inductor_compile)
    aot_trace(model, "cpu", backend)
    code = backend.record.graph_module.code
    # the graph that hung: lowered ops, the final norm's op first met after the last layer
    assert "atomc_triton.fused_add_rms_norm_fp8_quant_dynamic" in code and "atomc_triton.fp8_gemm" in code
    first_plain_norm = code.index("atomc_triton.fused_add_rms_norm.default")
    assert first_plain_norm > code.rindex("layers_modules_1_modules_mlp_modules_down_proj")
    assert "Creating implicit fallback" not in inductor_info_log.getvalue()
    assert printed == []
