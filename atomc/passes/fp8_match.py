"""What the FP8 passes share: the quant ops in either spelling, and a quant node's outputs.

The models call the FP8 ops as packets (`torch.ops.atomc.fp8_quant_dynamic(x, g)`), the passes and
the lowering as overloads (`.default`): both are matched. A dynamic quant returns (q, scale), read
through getitem nodes; a static one returns q itself.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

QUANT_STATIC = torch.ops.atomc.fp8_quant_static
QUANT_DYNAMIC = torch.ops.atomc.fp8_quant_dynamic
QUANTS = (QUANT_STATIC, QUANT_STATIC.default, QUANT_DYNAMIC, QUANT_DYNAMIC.default)


def quant_kind(node) -> str | None:
    """ "static" or "dynamic" for a call of an FP8 activation quant, else None."""
    if not isinstance(node, Node) or node.op != "call_function":
        return None
    if node.target in (QUANT_STATIC, QUANT_STATIC.default):
        return "static"
    if node.target in (QUANT_DYNAMIC, QUANT_DYNAMIC.default):
        return "dynamic"
    return None


def quant_args(node: Node) -> tuple:
    """(x, scale) of a static quant, (x, group_size) of a dynamic one, keywords folded in."""
    names = ("x", "scale") if quant_kind(node) == "static" else ("x", "group_size")
    return tuple(node.args[i] if i < len(node.args) else node.kwargs[name] for i, name in enumerate(names))


def getitem_users(node: Node) -> dict[int, list[Node]] | None:
    """{index: [getitem nodes]} of a multi-output node, or None if anything else reads it."""
    out: dict[int, list[Node]] = {}
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem:
            return None
        out.setdefault(user.args[1], []).append(user)
    return out


def example_values(node: Node) -> tuple:
    v = node.meta.get("example_value", node.meta.get("val"))
    return tuple(v) if isinstance(v, (tuple, list)) else (v,)
