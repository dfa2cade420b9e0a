"""Merge linears that read the same input (q/k/v, gate/up) into one GEMM.

At load (transform_module): models expose `merge_qkv()` / `merge_gate_up()`, which replace the
projections by one nn.Linear holding the concatenated weights; the traced graph then has one GEMM and
a split. This runs on every load, compile or warm start, because artifacts hold no weights.

On the graph (__call__), for graphs whose weights are constants (get_attr):
Pattern:      a = linear(x, Wa, ba);  b = linear(x, Wb, bb);  ...
Replacement:  a, b, ... = linear(x, cat([Wa, Wb, ...]), cat([ba, bb, ...])).split([Na, Nb, ...], -1)
Dynamo graphs take weights as inputs: merging those on the graph would concatenate them on every
step, so such groups are only counted (matched, not rewritten); the load-time merge covers them.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from atomc.passes import match
from atomc.passes.base import AtomcPass, PassResult


def _linear_args(node: Node):
    x = match.arg(node, 0, "input")
    w = match.arg(node, 1, "weight")
    b = match.arg(node, 2, "bias")
    return x, w, b


class MergeLinears(AtomcPass):
    name = "merge_linears"
    version = 1

    def transform_module(self, model: torch.nn.Module) -> int:
        changed = 0
        for module in list(model.modules()):
            for hook in ("merge_qkv", "merge_gate_up"):
                if hasattr(module, hook):
                    changed += bool(getattr(module, hook)())
        return changed

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        groups: dict[Node, list[Node]] = {}
        for node in gm.graph.nodes:
            if match.is_op(node, "linear"):
                groups.setdefault(_linear_args(node)[0], []).append(node)
        matched = rewritten = 0
        for linears in groups.values():
            if len(linears) < 2:
                continue
            matched += 1
            rewritten += self._merge(gm, linears)
        return PassResult(matched, rewritten, "" if matched == rewritten else "weights are graph inputs")

    def _merge(self, gm, linears: list[Node]) -> bool:
        weights, biases = [], []
        for node in linears:
            _, w, b = _linear_args(node)
            if not isinstance(w, Node) or w.op != "get_attr" or (b is not None and b.op != "get_attr"):
                return False
            weights.append(_fetch(gm, w.target))
            biases.append(None if b is None else _fetch(gm, b.target))
        if len({w.dtype for w in weights}) != 1 or len({b is None for b in biases}) != 1:
            return False
        sizes = [w.shape[0] for w in weights]
        base = linears[0].name + "_merged"
        w_name = _add_const(gm, base + "_weight", torch.cat(weights, 0))
        b_name = None if biases[0] is None else _add_const(gm, base + "_bias", torch.cat(biases, 0))
        x = _linear_args(linears[0])[0]
        first = linears[0]  # every linear of the group reads x, so the merged GEMM can sit at the first
        with gm.graph.inserting_before(first):
            w_node = gm.graph.get_attr(w_name)
            b_node = None if b_name is None else gm.graph.get_attr(b_name)
            merged = gm.graph.call_function(torch.nn.functional.linear, (x, w_node, b_node))
            parts = gm.graph.call_method("split", (merged, sizes, -1))
            outs = [gm.graph.call_function(operator.getitem, (parts, i)) for i in range(len(sizes))]
        for node, out in zip(linears, outs, strict=True):
            out.meta.update({k: v for k, v in node.meta.items() if k in ("example_value", "val")})
            node.replace_all_uses_with(out)
            gm.graph.erase_node(node)
        return True


def _fetch(gm: torch.fx.GraphModule, target: str) -> torch.Tensor:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _add_const(gm: torch.fx.GraphModule, name: str, value: torch.Tensor) -> str:
    name = name.replace(".", "_")
    gm.register_buffer(name, value.detach())
    return name
