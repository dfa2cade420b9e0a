"""Rewrite torch-level idioms into atomc ops (patterns in atomc/passes/patterns, one file each):
RMSNorm -> atomc.rms_norm, silu(a)*b -> atomc.silu_mul, rotate-half RoPE -> atomc.rope, every GEMM
spelling -> F.linear; atomc.attention is already canonical. Later passes fuse and lower these ops."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from atomc.passes import patterns
from atomc.passes.base import AtomcPass, PassResult
from atomc.passes.patterns import PATTERNS


class Canonicalize(AtomcPass):
    name = "canonicalize"

    def source_files(self) -> list[Path]:
        # the patterns live in their own files, and their list decides what runs
        files = [Path(inspect.getsourcefile(type(p))).resolve() for p in PATTERNS]
        return [*super().source_files(), Path(inspect.getsourcefile(patterns)).resolve(), *files]

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        matched = rewritten = 0
        notes = []
        for pattern in PATTERNS:
            m, r = pattern.apply(gm)
            matched, rewritten = matched + m, rewritten + r
            if m:
                notes.append(f"{pattern.name}={r}/{m}")
        return PassResult(matched, rewritten, ", ".join(notes))
