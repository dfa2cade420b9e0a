"""Remove ops that return their input unchanged, so the canonicalisation patterns see the plain
dataflow: casts to the dtype a tensor already has (fp32 models), views/reshapes to the same shape,
`.contiguous()` on a contiguous tensor and slices covering every dim.

Each removed op returns its input or an alias of it with the same shape and strides, so replacing
its uses by the input keeps in-place semantics too.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from atomc.passes import match
from atomc.passes.base import AtomcPass, PassResult

_CASTS = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16, "double": torch.float64}
_VIEWS = ("view", "reshape")


def _is_noop_cast(node: Node) -> bool:
    if node.op != "call_method":
        return False
    src = match.dtype(node.args[0])
    if src is None:
        return False
    if node.target in _CASTS:
        return not node.kwargs and _CASTS[node.target] == src
    if node.target in ("to", "type"):
        # only x.to(dtype): a device, `copy=True` or a memory format makes it something else
        if node.kwargs or len(node.args) != 2:
            return False
        return isinstance(node.args[1], torch.dtype) and node.args[1] == src
    return False


def _is_noop_view(node: Node) -> bool:
    is_view = node.op == "call_method" and node.target in _VIEWS
    is_view = is_view or (node.op == "call_function" and node.target in (torch.reshape,))
    if not is_view:
        return False
    # the output shape Dynamo recorded equals the input's: whatever the args said, it changed nothing
    return match.same_shape(node, node.args[0])


def _is_noop_contiguous(node: Node) -> bool:
    if node.op != "call_method" or node.target != "contiguous" or node.kwargs or len(node.args) != 1:
        return False
    v = match.val(node.args[0])
    return v is not None and v.is_contiguous()


def _full_slice(s) -> bool:
    if s is Ellipsis:
        return True
    return isinstance(s, slice) and s.start in (None, 0) and s.stop is None and s.step in (None, 1)


def _is_noop_slice(node: Node) -> bool:
    if not match.is_op(node, "getitem") or match.val(node.args[0]) is None:
        return False
    index = node.args[1]
    index = index if isinstance(index, tuple) else (index,)
    return all(_full_slice(s) for s in index) and match.same_shape(node, node.args[0])


CHECKS = (_is_noop_cast, _is_noop_view, _is_noop_contiguous, _is_noop_slice)


class NoopElimination(AtomcPass):
    name = "noop_elimination"

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        removed: dict[str, int] = {}
        for node in list(gm.graph.nodes):
            check = next((c for c in CHECKS if c(node)), None)
            if check is None:
                continue
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            key = check.__name__.removeprefix("_is_noop_")
            removed[key] = removed.get(key, 0) + 1
        n = sum(removed.values())
        notes = ", ".join(f"{k}={v}" for k, v in sorted(removed.items()))
        return PassResult(matched=n, rewritten=n, notes=notes)
