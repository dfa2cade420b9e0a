"""Every kernel of a step is one compiled variant at every token count of a bucket.

Triton compiles a variant of a kernel per value class of each int argument it specializes (1, a
multiple of 16, anything else) and per 16-byte alignment of each pointer. An argument that follows
the step's token count (tokens, pairs, sampled rows) would give a step of 49 tokens another variant
than one of 48: the start-up forwards run powers of two (runtime/capture_sizes.warm_up_sizes), so the
first serving step of another class compiled every such kernel again while all requests in flight
waited (a stall of about 0.75 s in a CONC-64 run on an H100: docs/performance.md section 28). Such
arguments are `do_not_specialize_on_alignment` (kept: the == 1 class, which decode graphs capture).

Each case runs a kernel family through the interpreter at token counts of every class and records
each launch's classes as the JIT would key them (InterpretedFunction keeps the decorator's lists).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from triton_interpreter import use_interpreter

use_interpreter()  # before the first triton import

triton = pytest.importorskip("triton")
from mla_latent_cases import layer_inputs  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton_kernel_cases import DEEPSEEK_ROUTINGS, cos_sin_cache, make_batch, make_moe  # noqa: E402

from atomc.kernels.triton import (  # noqa: E402
    fp8_quant,
    fused_add_rms_norm,
    fused_moe,
    mla_attention,
    mla_latent_norm_rope,
    moe_align,
    paged_attention,
    rms_norm,
    rope_and_write_kv,
    silu_and_mul,
    write_kv_cache,
    write_latent_cache,
)
from atomc.kernels.triton.argmax import argmax_rows  # noqa: E402
from atomc.kernels.triton.fp8_gemm import fp8_gemm  # noqa: E402
from atomc.kernels.triton.moe_quant import fused_moe_quant  # noqa: E402
from models.quant.mxfp4 import quantize_mxfp4  # noqa: E402

BASE = 48  # a multiple of 16; the others: odd, 2, 4 and 8 times an odd number
COUNTS = (49, 50, 52, 56)


def _names(fn: InterpretedFunction, listed) -> set[str]:
    return {fn.arg_names[a] if isinstance(a, int) else a for a in (listed or ())}


def value_class(v, no_specialize: bool, no_align: bool) -> str:
    """The class of one argument in the JIT's key (triton/runtime/jit.py's specialization)."""
    if isinstance(v, bool) or v is None or isinstance(v, float):
        return type(v).__name__
    if isinstance(v, int):
        if no_specialize:
            return "int"
        if v == 1:
            return "1"
        return "int" if no_align or v % 16 else "int D16"
    if isinstance(v, torch.Tensor):
        return "ptr" if no_specialize or no_align or v.data_ptr() % 16 else "ptr D16"
    return type(v).__name__


def launch_key(fn: InterpretedFunction, args, kwargs) -> tuple[str, dict[str, str]]:
    params = inspect.signature(fn.fn).parameters
    bound = {**dict(zip(fn.arg_names, args, strict=False)), **kwargs}
    no_spec = _names(fn, fn.kwargs.get("do_not_specialize"))
    no_align = _names(fn, fn.kwargs.get("do_not_specialize_on_alignment"))
    classes = {
        name: value_class(bound.get(name, p.default), name in no_spec, name in no_align)
        for name, p in params.items()
        if "constexpr" not in str(p.annotation)
    }
    return fn.fn.__qualname__, classes


def launches(monkeypatch, run_step, tokens: int) -> list[tuple[str, dict[str, str]]]:
    seen: list = []
    real = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        seen.append(launch_key(self, args, kwargs))
        return real(self, *args, grid=grid, warmup=warmup, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(InterpretedFunction, "run", recording)
        run_step(tokens)
    return seen


def differences(base, other) -> list[str]:
    if [name for name, _ in base] != [name for name, _ in other]:
        return [f"other kernels launched: {[n for n, _ in base]} against {[n for n, _ in other]}"]
    out = []
    for (name, a), (_, b) in zip(base, other, strict=True):
        out += [f"{name}.{arg}: {a[arg]} -> {b[arg]}" for arg in a if a[arg] != b[arg]]
    return out


# -- a step's kernels, each at `t` tokens (fp32: the interpreter mishandles bf16) -------------------


def _gen():
    return torch.Generator().manual_seed(0)


def norms(t):
    g = _gen()
    x, r, w = torch.randn(t, 64, generator=g), torch.randn(t, 64, generator=g), torch.ones(64)
    rms_norm(x, w, 1e-6)
    fused_add_rms_norm(x, r, w, 1e-6)


def rope_and_cache(t):
    g = _gen()
    q, k, v = (torch.randn(t, h, 32, generator=g) for h in (4, 2, 2))
    kc, vc = torch.zeros(8, 16, 2, 32), torch.zeros(8, 16, 2, 32)
    positions, slots = torch.arange(t), torch.arange(t)
    rope_and_write_kv(positions, q, k, v, cos_sin_cache(64, 32, "cpu"), kc, vc, slots)
    write_kv_cache(k, v, kc, vc, slots)


def activation(t):
    silu_and_mul(torch.randn(t, 96, generator=_gen()))


def _q_lens(t):
    return [t - 20, 12, 8]  # three prompts' chunks, the first of every length class


def attention(t):
    q_lens = _q_lens(t)
    q, kc, vc, meta = make_batch(q_lens, [ql + 5 for ql in q_lens], 4, 2, 32, torch.float32, "cpu", pad_tokens=0)
    out = torch.empty_like(q)
    paged_attention(
        q, kc, vc, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.2,
        meta.max_query_len, meta.max_seq_len, meta.num_seqs,
    )  # fmt: skip


def fp8_quants(t):
    g = _gen()
    x, w = torch.randn(t, 256, generator=g), torch.ones(256)
    for group in (256, 128):  # per token, per 128-value group
        fp8_quant.quant_dynamic(x, group)
        fp8_quant.rms_norm_quant(x, None, w, 1e-6, None, group)
        fp8_quant.rms_norm_quant(x, x.clone(), w, 1e-6, None, group)
        fp8_quant.silu_and_mul_quant(x, None, group)
    fp8_quant.quant_static(x, torch.ones(1))


def fp8_gemms(t):
    g = _gen()
    xq = torch.randn(t, 256, generator=g).to(torch.float8_e4m3fn)
    w = torch.randn(64, 256, generator=g).to(torch.float8_e4m3fn)
    fp8_gemm(xq, torch.ones(t, 1), w, torch.ones(64, 1), None, torch.float32)
    fp8_gemm(xq, torch.ones(t, 2), w, torch.ones(1, 2), None, torch.float32, block=(128, 128))


def moe_softmax(t):
    x, logits, w13, w2, _, _ = make_moe(t, 8, 64, 32, 2, torch.float32, "cpu")
    fused_moe(x, logits, w13, w2, None, None, None, None, 2)  # sorted route: 2t pairs


def moe_deepseek(t):
    _, k, scoring, _, _, _, renorm, scale = DEEPSEEK_ROUTINGS[0]
    experts, groups, keep = 16, 4, 2  # V3's routing on fewer experts
    # one shared expert after the routed ones: its weights, not its logit
    x, logits, w13, w2, _, _ = make_moe(t, experts + 1, 64, 32, k, torch.float32, "cpu")
    bias = torch.randn(experts, generator=_gen())
    fused_moe(
        x, logits[:, :experts].contiguous(), w13, w2, None, None, None, bias, k, scoring, renorm, groups, keep,
        scale, num_shared_experts=1,
    )  # fmt: skip


def moe_quantised(t):
    x, logits, w13, w2, _, _ = make_moe(t, 8, 64, 32, 2, torch.float32, "cpu")
    fp8 = [(w.to(torch.float8_e4m3fn), torch.ones(w.shape[:2])) for w in (w13, w2)]  # per-row scales
    fused_moe_quant(x, logits, fp8[0][0], fp8[0][1], fp8[1][0], fp8[1][1], None, None, None, None, 2, "fp8_channel")
    (q13, s13), (q2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    fused_moe_quant(x, logits, q13, s13, q2, s2, None, None, None, None, 2, "mxfp4")


def alignment(t):
    local = torch.randint(0, 8, (t * 2,), generator=_gen(), dtype=torch.int32)
    moe_align.align_by_expert_kernel(local, 8, 16)


def sampling(t):
    argmax_rows(torch.randn(t, 1000, generator=_gen()))  # rows: the step's sampled sequences


def mla(t):
    lora, rope = 40, 8
    args = layer_inputs(t, 4, lora, rope, torch.float32, "cpu", True)  # DeepSeek's layer, laid out
    mla_latent_norm_rope(*args)
    k_pe, c_kv = args[2], args[3]
    q_lens = _q_lens(t)
    qb, cache, _, meta = make_batch(q_lens, [ql + 5 for ql in q_lens], 4, 1, lora + rope, torch.float32, "cpu",
                                    page=8, pad_tokens=0)  # fmt: skip
    write_latent_cache(c_kv, k_pe, cache, torch.arange(t))
    out = torch.empty(t, 4, lora)
    mla_attention(
        qb[..., :lora], qb[..., lora:], cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        0.2, meta.max_query_len, meta.max_seq_len, meta.num_seqs,
    )  # fmt: skip


STEPS = [norms, rope_and_cache, activation, attention, fp8_quants, fp8_gemms, moe_softmax, moe_deepseek,
         moe_quantised, alignment, sampling, mla]  # fmt: skip


@pytest.mark.parametrize("run_step", STEPS, ids=lambda f: f.__name__)
def test_every_token_count_class_runs_the_variants_of_a_multiple_of_16(run_step, monkeypatch):
    base = launches(monkeypatch, run_step, BASE)
    assert base, "no kernel launched"
    found = {t: differences(base, launches(monkeypatch, run_step, t)) for t in COUNTS}
    assert not any(found.values()), "new variants: " + "; ".join(f"{t} tokens: {d}" for t, d in found.items() if d)


def test_the_classes_follow_the_jit():
    # a multiple of 16 and 1 are classes of their own; listed arguments lose the alignment class
    assert [value_class(v, False, False) for v in (48, 49, 1)] == ["int D16", "int", "1"]
    assert value_class(48, False, True) == "int" and value_class(1, False, True) == "1"
    assert value_class(1, True, False) == "int" and value_class(True, False, False) == "bool"
