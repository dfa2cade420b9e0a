"""Runs atomc's passes in order on the Dynamo graph and reports what each one did."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from atomc.passes.base import AtomcPass


@dataclass
class PassReport:
    name: str
    uuid: str
    matched: int
    rewritten: int
    seconds: float
    graph_after: str
    notes: str = ""


def default_passes(platform: str, tensor_parallel_size: int = 1) -> list[AtomcPass]:
    """The pipeline, in order. Each step relies on the one before it having normalised the graph.
    The all-reduce fusion joins at tensor-parallel size > 1 only: at size 1 there is no all-reduce
    to match, and a size-1 build keeps the pass list (so the cache key) it had before the pass."""
    from atomc.passes.canonicalize import Canonicalize
    from atomc.passes.decode_gemv import DecodeGemv
    from atomc.passes.fuse_add_rmsnorm import FuseAddRMSNorm
    from atomc.passes.fuse_allreduce_rmsnorm import FuseAllReduceRMSNorm
    from atomc.passes.fuse_fp8_quant_linear import FuseFP8QuantLinear
    from atomc.passes.fuse_mla_latent_norm_rope import FuseMLALatentNormRope
    from atomc.passes.fuse_qk_norm_rope import FuseQKNormRope
    from atomc.passes.fuse_rmsnorm_fp8_quant import FuseRMSNormFP8Quant
    from atomc.passes.fuse_rope_kv_write import FuseRopeKVWrite
    from atomc.passes.fuse_silu_mul import FuseSiluMul
    from atomc.passes.fuse_silu_mul_fp8_quant import FuseSiluMulFP8Quant
    from atomc.passes.lowering import Lowering
    from atomc.passes.noop_elimination import NoopElimination
    from atomc.passes.share_fp8_quant import ShareFP8Quant

    # after the add + norm and the norm + FP8 quant fusions: it extends the fused add + norm they leave
    tensor_parallel = [FuseAllReduceRMSNorm()] if tensor_parallel_size > 1 else []
    return [
        NoopElimination(),
        Canonicalize(),
        FuseAddRMSNorm(),
        FuseSiluMul(),
        ShareFP8Quant(),
        FuseRMSNormFP8Quant(),
        *tensor_parallel,
        FuseSiluMulFP8Quant(),
        FuseFP8QuantLinear(platform),
        FuseRopeKVWrite(),
        FuseQKNormRope(),
        FuseMLALatentNormRope(),
        DecodeGemv(platform),
        Lowering(platform),
    ]


PLATFORMS = ("cpu", "cuda", "rocm")


class PassManager:
    def __init__(self, passes: list[AtomcPass]):
        names = [p.name for p in passes]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate pass names: {names}")
        self.passes = list(passes)

    @classmethod
    def for_platform(cls, platform: str, disabled: Iterable[str] = (), tensor_parallel_size: int = 1) -> PassManager:
        if platform not in PLATFORMS:
            raise ValueError(f"unknown platform {platform!r} (valid: {', '.join(PLATFORMS)})")
        passes = default_passes(platform, tensor_parallel_size)
        # a name is valid at any size: one --disable-pass list serves -tp 1 and -tp N
        valid = [p.name for p in default_passes(platform, tensor_parallel_size=2)]
        unknown = sorted(set(disabled) - set(valid))
        if unknown:
            raise ValueError(f"unknown pass name(s) {unknown} (valid: {', '.join(valid)})")
        return cls([p for p in passes if p.name not in set(disabled)])

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.passes]

    def uuids(self) -> list[tuple[str, str]]:
        return [(p.name, p.uuid()) for p in self.passes]

    def source_files(self) -> list[Path]:
        """Every pass's source files (the cache key hashes them with their project imports)."""
        return sorted({f for p in self.passes for f in p.source_files()})

    def run(self, gm: torch.fx.GraphModule) -> list[PassReport]:
        reports = []
        for p in self.passes:
            start = time.perf_counter()
            result = p(gm)
            gm.graph.lint()
            gm.recompile()
            seconds = time.perf_counter() - start
            reports.append(
                PassReport(p.name, p.uuid(), result.matched, result.rewritten, seconds, gm.code, result.notes)
            )
        return reports
