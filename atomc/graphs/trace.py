"""One Dynamo trace of the model's forward over a flat token batch, then atomc's passes, then Inductor.

The traced function is the unbound `forward(model, input_ids, positions)`: the module is an
argument, so weights are graph inputs and the artifact never holds them. The token dim is unbacked,
so one graph serves every batch size from 1 up (no 0/1 specialisation, no recompiles).

A pipeline stage after the first (`model.parallel.stage` > 0) starts from the previous stage's
hidden states, not from token ids: its trace is `forward(model, None, positions, hidden)`, hidden
[T, hidden_size] in the model's dtype with T unbacked. Which of the two an artifact takes is its
calling convention (`input_kind`: IDS or HIDDEN), recorded in its manifest; `bind` hides it, so
either compiled forward is called as the eager model is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from atomc import compat
from atomc.graphs.partition import partition_plan, splitting_ops_in
from atomc.graphs.report import graph_flops

EXAMPLE_TOKENS = 8  # any value works: the dim is unbacked, this only feeds the example run

IDS = "ids"  # forward(model, input_ids, positions): a whole model, or a pipeline's first stage
HIDDEN = "hidden"  # forward(model, None, positions, hidden): a pipeline stage after the first


def input_kind(model: torch.nn.Module) -> str:
    """What `model`'s forward starts from: token ids, or the previous pipeline stage's hidden states."""
    parallel = getattr(model, "parallel", None)
    return HIDDEN if parallel is not None and not parallel.first_stage else IDS


def example_inputs(model: torch.nn.Module, device: str | torch.device, tokens: int = EXAMPLE_TOKENS) -> tuple:
    """The trace's arguments after the module: (input_ids, positions), or (None, positions, hidden)."""
    positions = torch.arange(tokens, dtype=torch.long, device=device)
    compat.mark_unbacked(positions, 0)
    if input_kind(model) == HIDDEN:
        dtype = next(model.parameters()).dtype
        hidden = torch.zeros(tokens, model.config.hidden_size, dtype=dtype, device=device)
        compat.mark_unbacked(hidden, 0)
        return None, positions, hidden
    input_ids = torch.zeros(tokens, dtype=torch.long, device=device)
    compat.mark_unbacked(input_ids, 0)
    return input_ids, positions


@dataclass
class TraceRecord:
    """What the backend saw and did; filled in while aot_compile runs."""

    started: float = field(default_factory=time.perf_counter)
    graph_before: str = ""
    pass_reports: list = field(default_factory=list)
    plan: list[dict] = field(default_factory=list)
    splitting_ops: list[str] = field(default_factory=list)
    flops: dict = field(default_factory=dict)
    flops_before: dict = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    graph_module: torch.fx.GraphModule | None = None
    example_inputs: list = field(default_factory=list)
    traced_files: set[str] = field(default_factory=set)  # the Python files Dynamo traced (absolute)


class AtomcBackend:
    """Dynamo backend: passes on the FX graph, then `compile_fn` (Inductor by default)."""

    def __init__(self, pass_manager, on_phase: Callable[[str], None] | None = None, compile_fn=None):
        self.pm = pass_manager
        self.on_phase = on_phase or (lambda _name: None)
        self.compile_fn = compile_fn or inductor_compile
        self.record = TraceRecord()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list):
        rec = self.record
        now = time.perf_counter()
        rec.timings["trace_s"] = now - rec.started
        self.on_phase("trace")
        rec.graph_before = gm.code
        rec.traced_files = compat.traced_files(gm)
        rec.flops_before = graph_flops(gm)
        rec.pass_reports = self.pm.run(gm)
        rec.flops = graph_flops(gm, baseline=rec.flops_before)
        rec.plan = partition_plan(gm)
        rec.splitting_ops = splitting_ops_in(gm)
        rec.graph_module, rec.example_inputs = gm, list(example_inputs)
        t1 = time.perf_counter()
        rec.timings["passes_s"] = t1 - now
        self.on_phase("passes")
        compiled = self.compile_fn(gm, example_inputs, rec.splitting_ops)
        rec.timings["inductor_s"] = time.perf_counter() - t1
        self.on_phase("inductor")
        return compiled


def inductor_compile(gm: torch.fx.GraphModule, example_inputs: list, splitting_ops: list[str]):
    from torch._inductor.compile_fx import compile_fx

    compat.register_inductor_fallbacks(gm)  # before lowering: torch 2.11's implicit ones can hang it
    with torch._inductor.config.patch(compat.inductor_partition_options(splitting_ops)):
        compiled = compile_fx(gm, example_inputs)
    return compat.serializable_callable(compiled)


def aot_trace(model: torch.nn.Module, device: str, backend: AtomcBackend):
    """Trace + compile; returns torch's serializable AOTCompiledFunction of (model, *example_inputs)."""
    args = example_inputs(model, device)
    backend.record.started = time.perf_counter()
    with torch.no_grad():
        return compat.aot_compile(type(model).forward, (model, *args), backend)


def bind(compiled: Callable, model: torch.nn.Module, kind: str = IDS) -> Callable[..., torch.Tensor]:
    """The compiled forward with this process's module (and its freshly loaded weights) bound in,
    called as the eager model is: `forward(input_ids, positions)`, or for a stage after the first
    (`kind` HIDDEN) `forward(input_ids, positions, hidden)`, whose ids it never reads."""
    if kind == HIDDEN:

        def forward(input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None = None):
            if hidden is None:
                raise ValueError("this compiled pipeline stage starts from the previous stage's hidden states")
            return compiled(model, None, positions, hidden)

    else:

        def forward(input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None = None):
            return compiled(model, input_ids, positions)

    forward.compiled = compiled  # type: ignore[attr-defined]
    forward.input_kind = kind  # type: ignore[attr-defined]
    return forward
