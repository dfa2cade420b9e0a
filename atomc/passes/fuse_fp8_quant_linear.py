"""A per-token FP8 quant read by one FP8 GEMM becomes part of that linear.

Pattern:      q, s = atomc.fp8_quant_dynamic(x, g);               y = atomc.fp8_gemm(q, s, w, ws, b, dt)
              q, s = atomc.silu_and_mul_fp8_quant_dynamic(h, g);  y = atomc.fp8_gemm(q, s, w, ws, b, dt)
Replacement:  y = atomc.fp8_linear_dynamic(x, g, w, ws, b, dt, False)  (h, ..., True)
The quants left after the norm fusions are the o projection's (its input comes from attention) and
the down projection's (fused with SiLU·mul). As part of the linear, a backend may skip them: the CUDA
backend can at one row (W8A16, atomc/ops/fp8_linear.py), a launch a linear off the batch-1 step,
but that path is off: an H100 timed it slower end to end (docs/quantization.md). Declined when
the quant's outputs have another reader (share_fp8_quant left it to several GEMMs, or something
else reads the e4m3 copy) and for a scale other than per token (per tensor, 0, needs the whole
batch's amax). On ROCm the quant and AITER's GEMM stay apart: the
op has no AITER binding and no one-row path there has been measured.
"""

from __future__ import annotations

import operator

import torch

from atomc.passes import match
from atomc.passes.base import FusionPass
from atomc.passes.fp8_match import QUANT_DYNAMIC, example_values, getitem_users, quant_args, row_length
from atomc.passes.rewrite import call, erase_dead

FP8_GEMM = (torch.ops.atomc.fp8_gemm, torch.ops.atomc.fp8_gemm.default)
SILU_QUANT = (torch.ops.atomc.silu_and_mul_fp8_quant_dynamic, torch.ops.atomc.silu_and_mul_fp8_quant_dynamic.default)
PLAIN_QUANT = (QUANT_DYNAMIC, QUANT_DYNAMIC.default)
FUSED = torch.ops.atomc.fp8_linear_dynamic.default
PLATFORMS = ("cpu", "cuda")
GEMM_ARGS = ("xq", "x_scale", "weight", "weight_scale", "bias", "out_dtype")


def _quant_of(gemm):
    """(quant node, its input, group size, silu) when the GEMM's (q, s) are one dynamic quant's
    outputs 0 and 1 and nothing else reads them; else None."""
    q, s = match.arg(gemm, 0, "xq"), match.arg(gemm, 1, "x_scale")
    if not all(isinstance(n, torch.fx.Node) and n.target is operator.getitem for n in (q, s)):
        return None
    quant = q.args[0]
    if s.args[0] is not quant or (q.args[1], s.args[1]) != (0, 1) or quant.op != "call_function":
        return None
    if quant.target in PLAIN_QUANT:
        x, group = quant_args(quant)
        silu = False
    elif quant.target in SILU_QUANT:
        x, group = match.arg(quant, 0, "x"), match.arg(quant, 1, "group_size")
        silu = True
    else:
        return None
    items = getitem_users(quant)
    if items is None or set(items) != {0, 1} or items[0] != [q] or items[1] != [s]:
        return None
    if set(q.users) != {gemm} or set(s.users) != {gemm}:
        return None
    row = row_length(q)  # the e4m3 activation's, after SiLU·mul
    if row is None or group != row:
        return None  # per token only (0, one scale for the tensor, stays a quant of its own)
    return quant, x, group, silu


class FuseFP8QuantLinear(FusionPass):
    name = "fuse_fp8_quant_linear"
    anchor = FP8_GEMM

    def __init__(self, platform: str = "cpu"):
        self.platform = platform

    def source_files(self):
        # the FP8 matchers it shares with the other FP8 passes decide what it matches too
        here = super().source_files()[0]
        return [here, here.with_name("fp8_match.py")]

    def match(self, gemm):
        found = _quant_of(gemm)
        return (gemm, *found) if found is not None else None

    def rewrite(self, gm, m) -> bool:
        if self.platform not in PLATFORMS:
            return False
        gemm, quant, x, group, silu = m
        _, _, weight, weight_scale, bias, out_dtype = (match.arg(gemm, i, name) for i, name in enumerate(GEMM_ARGS))
        if not isinstance(out_dtype, torch.dtype):
            return False
        with gm.graph.inserting_before(gemm):
            args = (x, group, weight, weight_scale, bias, out_dtype, silu)
            new = call(gm.graph, FUSED, args, example_values(gemm)[0])
        gemm.replace_all_uses_with(new)
        items = getitem_users(quant)
        erase_dead(gm.graph, [gemm, *items[0], *items[1], quant])
        return True

    def notes(self) -> str:
        return "" if self.platform in PLATFORMS else f"quant and GEMM kept apart on {self.platform}"
