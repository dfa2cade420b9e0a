"""Small helpers for hand-matching torch-level FX graphs from Dynamo.

Dynamo records the same op in several spellings (`x.mul(y)`, `x * y`, `torch.mul(x, y)`), so the
predicates here accept each spelling of an op rather than one exact target.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

# spellings of one op: call_function targets plus the Tensor method name
OPS: dict[str, tuple[tuple, str | None]] = {
    "mul": ((operator.mul, torch.mul, torch.Tensor.mul), "mul"),
    "add": ((operator.add, torch.add, torch.Tensor.add), "add"),
    "neg": ((operator.neg, torch.neg, torch.Tensor.neg), "neg"),
    "rsqrt": ((torch.rsqrt, torch.Tensor.rsqrt), "rsqrt"),
    "pow": ((operator.pow, torch.pow, torch.Tensor.pow), "pow"),
    "mean": ((torch.mean, torch.Tensor.mean), "mean"),
    "cat": ((torch.cat, torch.concat, torch.concatenate), None),
    "chunk": ((torch.chunk, torch.Tensor.chunk), "chunk"),
    "split": ((torch.split, torch.Tensor.split), "split"),
    "unsqueeze": ((torch.unsqueeze, torch.Tensor.unsqueeze), "unsqueeze"),
    "silu": ((torch.nn.functional.silu, torch.ops.aten.silu.default), None),
    "linear": ((torch.nn.functional.linear, torch.ops.aten.linear.default), None),
    "getitem": ((operator.getitem,), None),
}


def is_op(node, name: str) -> bool:
    if not isinstance(node, Node):
        return False
    targets, method = OPS[name]
    if node.op == "call_function":
        return node.target in targets
    return node.op == "call_method" and method is not None and node.target == method


def calls(gm: torch.fx.GraphModule, what) -> list[Node]:
    """The nodes calling `what` (a call_function target, a tuple of them, or an OPS name for every
    spelling), as a list taken now, so a rewrite may edit the graph while walking it."""
    if isinstance(what, str):
        return [n for n in gm.graph.nodes if is_op(n, what)]
    targets = what if isinstance(what, tuple) else (what,)
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


def arg(node: Node, index: int, kw: str | None = None, default=None):
    """Positional-or-keyword argument, the way both call_function and call_method nodes store it
    (for call_method, args[0] is self)."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(kw, default) if kw else default


def val(node):
    """The example (fake) tensor Dynamo recorded for a node, or None."""
    if not isinstance(node, Node):
        return None
    v = node.meta.get("example_value", node.meta.get("val"))
    return v if isinstance(v, torch.Tensor) else None


def ndim(node) -> int | None:
    v = val(node)
    return None if v is None else v.dim()


def dtype(node) -> torch.dtype | None:
    v = val(node)
    return None if v is None else v.dtype


def same_shape(a, b) -> bool:
    va, vb = val(a), val(b)
    if va is None or vb is None or va.dim() != vb.dim():
        return False
    return all(statically_known_true(x == y) for x, y in zip(va.shape, vb.shape, strict=True))


def is_last_dim(dim, node) -> bool:
    n = ndim(node)
    return dim == -1 or (n is not None and dim == n - 1)


def operands(node: Node) -> tuple:
    """(a, b) of a binary op node in either spelling."""
    return node.args[0], node.args[1]


def commuted(node: Node) -> Iterable[tuple]:
    a, b = operands(node)
    yield a, b
    yield b, a
