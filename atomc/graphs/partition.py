"""Where the graph is cut: around the ops that read the forward context (KV cache, batch metadata).

atomc captures whole-forward CUDA graphs (the runtime's concern, atomc/runtime/), so the cut is not
for piecewise graphs. It serves two things: Inductor's graph partition (its output is cut at these
ops, `compat.inductor_partition_options`), and the `pieces` fallback artifact format, which FX-splits
the graph here (split_graph) and compiles each piece alone. The list of such ops is the kernel
registry's (`registry.CONTEXT_OPS`, in every backend namespace); an op in an atomc namespace that the
registry does not know is an error, not a guess.
"""

from __future__ import annotations

import functools

import torch

from atomc.kernels import registry


class UnknownAtomcOp(RuntimeError):
    """The graph calls an atomc op the kernel registry does not list, so nothing says whether the
    graph must be cut there."""


@functools.cache
def splitting_ops() -> tuple[str, ...]:
    """Every op the graph is cut at, in every backend namespace (atomc, atomc_triton, atomc_aiter)."""
    return tuple(registry.splitting_op_names())


def op_name(node: torch.fx.Node) -> str | None:
    """'namespace::name' of a call_function node's op, or None."""
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def is_splitting(node: torch.fx.Node) -> bool:
    name = op_name(node)
    if name is None:
        return False
    if registry.is_known(name) is False:
        raise UnknownAtomcOp(
            f"{name} is not in atomc/kernels/registry.py: list it in OPS (and in CONTEXT_OPS if it reads "
            "the forward context), so lowering and the graph cut know what it is"
        )
    return name in splitting_ops()


def splitting_ops_in(gm: torch.fx.GraphModule) -> list[str]:
    """Inductor's partition list: every splitting op (those absent from this graph cost nothing)."""
    for node in gm.graph.nodes:
        is_splitting(node)  # fails on an unknown atomc op before Inductor sees the graph
    return list(splitting_ops())


def partition_plan(gm: torch.fx.GraphModule) -> list[dict]:
    """Ordered pieces: graph pieces alternating with splitting ops (for the report)."""
    plan: list[dict] = []
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if is_splitting(node):
            if current:
                plan.append({"kind": "graph", "nodes": current})
            plan.append({"kind": "split", "op": op_name(node)})
            current = 0
        else:
            current += 1
    if current:
        plan.append({"kind": "graph", "nodes": current})
    for i, piece in enumerate(plan):
        piece["index"] = i
    return plan


def split_graph(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[tuple[str, bool]]]:
    """FX-split at splitting ops: every splitting node gets its own submodule. Returns the split
    module and its submodules in call order as (name, is_splitting)."""
    from torch.fx.passes.split_module import split_module

    part, in_split, ids = 0, False, {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_splitting(node):
            part += 1
            ids[node] = part
            in_split = True
        else:
            if in_split:
                part += 1
                in_split = False
            ids[node] = part
    split = split_module(gm, None, lambda n: ids[n], keep_original_order=True)
    order = []
    for node in split.graph.nodes:
        if node.op == "call_module":
            sub = getattr(split, node.target)
            order.append((node.target, any(is_splitting(n) for n in sub.graph.nodes)))
    return split, order

