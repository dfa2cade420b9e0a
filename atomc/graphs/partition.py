"""Where the graph is cut for piecewise CUDA graphs, and the batch sizes those graphs are captured at.

Ops that read per-step state (the KV cache, batch metadata) or talk to other ranks cannot live
inside a captured graph, so the graph is cut around them: Inductor cuts its own output there
(graph_partition), and the fallback format cuts the FX graph itself (split_graph).
"""

from __future__ import annotations

import functools

import torch

# Always cut here; the kernel registry adds every backend's context-reading ops (see splitting_ops()).
SPLITTING_OPS = ("atomc::attention", "atomc::paged_attention", "atomc::rope_and_write_kv", "atomc::all_reduce")


@functools.cache
def splitting_ops() -> tuple[str, ...]:
    """Every op the graph is cut at: those that read the forward context (KV cache, batch metadata)
    or talk to other ranks, in every backend namespace (atomc, atomc_triton, atomc_aiter)."""
    try:
        from atomc.kernels.registry import splitting_op_names

        extra = splitting_op_names()
    except ImportError:
        extra = []
    return tuple(sorted(set(SPLITTING_OPS) | set(extra)))


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
    ns, _, op = name.partition("::")
    # a new attention-like op a pass introduces is cut too, even before it is listed
    return name in splitting_ops() or (ns.startswith("atomc") and "attention" in op)


def splitting_ops_in(gm: torch.fx.GraphModule) -> list[str]:
    """Inductor's partition list: the known splitting ops plus any found in this graph."""
    names = {op_name(n) for n in gm.graph.nodes if is_splitting(n)}
    return sorted(set(splitting_ops()) | {n for n in names if n})


def partition_plan(gm: torch.fx.GraphModule) -> list[dict]:
    """Ordered pieces: graph pieces (captured) alternating with splitting ops (run eagerly)."""
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


def default_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """1, 2, 4, then every 8 up to the largest decode batch (a decode step is one token a sequence)."""
    top = max(1, min(max_num_seqs, max_num_batched_tokens))
    ladder = [1, 2, 4] + list(range(8, top + 1, 8))
    return sorted({s for s in ladder if s <= top} | {top})


def resolve_capture_sizes(sizes: list[int] | None, max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    if sizes is None:
        return default_capture_sizes(max_num_seqs, max_num_batched_tokens)
    bad = [s for s in sizes if s < 1 or s > max_num_batched_tokens]
    if bad:
        raise ValueError(f"--cudagraph-capture-sizes {bad} outside 1..{max_num_batched_tokens} (max tokens)")
    return sorted(set(sizes))


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
