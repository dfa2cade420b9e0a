"""Swap each atomc op for the platform's backend implementation (atomc/kernels/registry.py):
cpu -> torch (the reference bodies; nothing changes), cuda -> triton, rocm -> aiter, then triton.
The backend ops share the atomc schemas, so only `node.target` changes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from atomc.kernels import registry
from atomc.passes.base import AtomcPass, PassResult


def atomc_op_name(node: torch.fx.Node) -> str | None:
    """'rms_norm' for a call to torch.ops.atomc.rms_norm(.default), else None."""
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    if isinstance(target, torch._ops.OpOverloadPacket) and target._qualified_op_name.startswith("atomc::"):
        return target._qualified_op_name.removeprefix("atomc::")
    return None


class Lowering(AtomcPass):
    name = "lowering"

    def __init__(self, platform: str = "cpu"):
        if platform not in registry.PLATFORM_BACKENDS:
            valid = ", ".join(registry.PLATFORM_BACKENDS)
            raise ValueError(f"unknown platform {platform!r} (valid: {valid})")
        self.platform = platform

    def source_files(self) -> list[Path]:
        # the registry decides how each platform lowers; the backend op modules it picks define
        # what the lowered graph calls (atomc/ops on cpu, the Triton bindings on cuda, ...)
        modules = [registry.__name__, *registry.chosen_modules(self.platform)]
        return [*super().source_files(), *(Path(importlib.util.find_spec(m).origin).resolve() for m in modules)]

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        matched = rewritten = 0
        chosen: dict[str, str] = {}
        for node in gm.graph.nodes:
            op = atomc_op_name(node)
            if op is None or op not in registry.OPS:
                continue
            matched += 1
            backend, target = registry.choose(op, self.platform)
            chosen[op] = backend
            if target is not node.target:
                node.target = target
                rewritten += 1
        notes = ", ".join(f"{op}->{b}" for op, b in sorted(chosen.items()))
        return PassResult(matched, rewritten, notes)
