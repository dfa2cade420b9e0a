"""What the FP8 passes share: the quant ops in either spelling, and a quant node's outputs.

The models call the FP8 ops as packets (`torch.ops.atomc.fp8_quant_dynamic(x, g)`), the passes and
the lowering as overloads (`.default`): both are matched. A dynamic quant returns (q, scale), read
through getitem nodes; a static one returns q itself.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from atomc.passes import match

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


def group_ok(kind: str, arg, row: int | None) -> bool:
    """A dynamic group the fused op takes, or a static scale that exists before the norm (the fused
    op is placed where the norm was: the graph's inputs, a checkpoint scale, always are)."""
    if kind == "static":
        return isinstance(arg, torch.fx.Node) and arg.op in ("placeholder", "get_attr")
    return isinstance(arg, int) and arg > 0 and row is not None and row % arg == 0


def row_length(node) -> int | None:
    v = match.val(node)
    if v is None or not isinstance(v.shape[-1], int):
        return None
    return v.shape[-1]


def replace_quant_outputs(quant, kind, new_q, new_s) -> None:
    """Point every reader of the quant's q (and dynamic scale) at the new nodes."""
    if kind == "static":
        quant.replace_all_uses_with(new_q)
        return
    for index, items in getitem_users(quant).items():
        for item in items:
            item.replace_all_uses_with(new_q if index == 0 else new_s)


def fusable_quant(quant: Node, src: Node) -> tuple[str, object] | None:
    """(kind, scale or group) when `quant` may take over `src`'s output: the quant is its only
    reader, the fused op takes the group (or the static scale exists before `src`), and a dynamic
    quant's outputs are read through getitems only; else None."""
    kind = quant_kind(quant)
    _, arg = quant_args(quant)
    if set(src.users) != {quant} or not group_ok(kind, arg, row_length(src)):
        return None
    if kind == "dynamic" and getitem_users(quant) is None:
        return None
    return kind, arg
