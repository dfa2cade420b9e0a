"""Rewrite torch-level idioms into atomc ops (patterns in atomc/passes/patterns, one file each):
RMSNorm -> atomc.rms_norm, silu(a)*b -> atomc.silu_mul, rotate-half RoPE -> atomc.rope, every GEMM
spelling -> F.linear; atomc.attention is already canonical. Later passes fuse and lower these ops."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from atomc.passes.base import AtomcPass, PassResult
from atomc.passes.patterns import PATTERNS


class Canonicalize(AtomcPass):
    name = "canonicalize"
    version = 1

    def uuid(self) -> str:
        # the patterns live in their own files: hash them into this pass's id as well
        h = hashlib.sha256(super().uuid().encode())
        for path in sorted(Path(__file__).with_name("patterns").glob("*.py")):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
        h.update(",".join(p.name for p in PATTERNS).encode())
        return h.hexdigest()

    def __call__(self, gm: torch.fx.GraphModule) -> PassResult:
        matched = rewritten = 0
        notes = []
        for pattern in PATTERNS:
            m, r = pattern.apply(gm)
            matched, rewritten = matched + m, rewritten + r
            if m:
                notes.append(f"{pattern.name}={r}/{m}")
        return PassResult(matched, rewritten, ", ".join(notes))
