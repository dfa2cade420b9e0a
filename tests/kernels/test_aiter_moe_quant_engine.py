"""Quantised MoE models through the ROCm lowering on CPU, as test_aiter_engine.py runs the bf16 ones:
the stand-in `aiter` installed, the "rocm" pass pipeline forced, Triton marked unavailable, and the
loader told the device runs AITER (atomc.platforms.uses_aiter), so the experts are laid out for
AITER at load (models/quant/aiter.py) and the compiled graph runs them on the stand-in's fused_moe.
This checks the wiring, not AMD hardware: none of the AITER path has run there.

- GPT-OSS with MXFP4 experts (tests/quant/mxfp4_checkpoints.py), bf16, as an MI350: H and I (64)
  padded to 256 at load, Swiglu with fp32 biases, activations kept bf16 (a16w4), which is the
  reference's math: the greedy tokens are those of the plain CPU reference run (eager, row-major
  experts, no AITER anywhere), up to a near-tie of bf16 rounding (HALF_MARGIN), and so are the
  logprobs on the steps they share (`assert_close_runs`).
- Qwen3-MoE with block FP8 experts and Mixtral with per-channel ones
  (tests/quant/fp8_moe_checkpoints.py), fp16, as an MI350 and as an MI300 (experts and linears in
  float8_e4m3fnuz): AITER runs the experts W8A8 (fused_moe quantises both GEMM inputs), the
  reference weight-only, which moves these tiny models' near-flat logits enough to part greedy runs
  (measured: at step 9 of 12, by 0.3 in a logit). So the compiled run is compared with an eager run
  whose experts quantise their GEMM inputs as AITER does (`w8a8_experts`, on the stand-in's grid,
  and atomc's FP8 quants on the GPU's e4m3 grid as test_aiter_fp8_engine.py does), up to a near-tie
  and on logprobs; the FP8 fusion passes are off (their fp32-vs-fp16 rounding is
  test_aiter_fp8_engine.py's subject). The logprobs differ from that run's by at most 0.09 (from the
  weight-only run's by up to 0.17), as the compiled run's other ops round differently.
In every case an eager run on the AITER layout (the reference reading the `_shuffled` formats) gives
exactly the plain run's tokens for FP8 (same values: unshuffled, fnuz with doubled scales) and up to a
near-tie for MXFP4 (its padded GEMMs sum zeros in another order).
"""

from __future__ import annotations

import contextlib

import fake_aiter
import fake_aiter_fp8
import pytest
import torch
import torch.nn.functional as F

from atomc import LLM, SamplingParams, platforms
from atomc.config import EngineConfig
from atomc.kernels import registry
from atomc.ops import fp8 as fp8_ops
from atomc.ops import moe_quant as moe_quant_ops
from atomc.ops.moe import apply_activation
from tests.greedy import assert_greedy_agree, model_logits

PROMPTS = ["The capital of France is", "Once upon a time there", "def add(a, b):\n"]
FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
HALF_MARGIN = 0.1  # bf16 / fp16 rounding of logits of a few units (test_aiter_engine.py)
FP8_FUSIONS = ["fuse_rmsnorm_fp8_quant", "fuse_silu_mul_fp8_quant"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("aiter-moe-quant"), {}

    def get(name):
        if name not in made:
            if name == "gpt_oss_mxfp4":
                from tests.quant import mxfp4_checkpoints

                made[name] = mxfp4_checkpoints.build(root / name)[1]
            else:
                from tests.quant import fp8_moe_checkpoints as mc

                family, layout = {"qwen3_fp8_block": ("qwen3_moe", "hf-block"),
                                  "mixtral_fp8_channel": ("mixtral", "ct-FP8_DYNAMIC")}[name]  # fmt: skip
                made[name] = mc.write(mc.base(family, root / f"{name}-base"), root / name, layout)
        return made[name]

    return get


def rocm_with_aiter(monkeypatch, fp8):
    """This CPU as a ROCm GPU running AITER, whose e4m3 is `fp8`: stand-in, lowering and loader."""
    from atomc.passes.manager import PassManager

    fake_aiter.install(monkeypatch, fp8=fp8)
    monkeypatch.setattr(registry, "backend_available", lambda backend: backend != "triton")
    monkeypatch.setattr(platforms, "uses_aiter", lambda device: True)  # the loader lays weights out for AITER
    monkeypatch.setattr(platforms, "fp8_dtype", lambda device: fp8)
    for_platform = PassManager.for_platform.__func__
    rocm = classmethod(lambda cls, platform, disabled=(), **kw: for_platform(cls, "rocm", disabled, **kw))
    monkeypatch.setattr(PassManager, "for_platform", rocm)
    fake_aiter.CALLS.clear()


CASES = {  # case -> (checkpoint, dtype, the format the experts are laid out in, GPUs)
    "gpt_oss_mxfp4": ("gpt_oss_mxfp4", "bfloat16", "mxfp4_shuffled", [FN]),
    "qwen3_fp8_block": ("qwen3_fp8_block", "float16", "fp8_block_shuffled", [FN, FNUZ]),
    "mixtral_fp8_channel": ("mixtral_fp8_channel", "float16", "fp8_channel_shuffled", [FN, FNUZ]),
}
RUNS = [(case, fp8) for case, (*_, gpus) in CASES.items() for fp8 in gpus]


def experts_of(llm):
    layer = llm.engine.runner.model.model.layers[0].mlp.experts
    return layer, layer.moe_method


@contextlib.contextmanager
def w8a8_experts(fp8, group):
    """Eager atomc::moe_quant quantising each expert GEMM's input as AITER's fused_moe does (dynamic,
    `group` values a scale: 0 for a whole row; amax / max of `fp8`, the stand-in's quant), and
    atomc's FP8 linears' quants on the same e4m3 grid."""

    def fake_quant(t):
        rows = t.float().reshape(-1, t.shape[-1])
        g = group or rows.shape[1]
        q, scale = fake_aiter_fp8._dynamic(rows, g)
        return (q.float() * scale.repeat_interleave(g, dim=-1)).view(t.shape)

    def experts(x, weights, ids, w13, w2, w13_bias, w2_bias, expert_map, activation, alpha, limit):
        local = ids.long() if expert_map is None else expert_map[ids.long()].long()
        out = torch.zeros(x.shape, dtype=torch.float32)
        for e in torch.unique(local[local >= 0]).tolist():
            token, slot = torch.nonzero(local == e, as_tuple=True)
            h = F.linear(fake_quant(x[token]), w13[e].float())
            a = apply_activation(h, activation, alpha, limit).to(x.dtype)
            y = F.linear(fake_quant(a), w2[e].float()).to(x.dtype)
            out.index_add_(0, token, y.float() * weights[token, slot, None])
        return out.to(x.dtype)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe_quant_ops, "experts_reference", experts)
        mp.setattr(fp8_ops, "FP8_DTYPE", fp8)
        mp.setattr(fp8_ops, "FP8_MAX", torch.finfo(fp8).max)
        yield


@pytest.mark.parametrize("case,fp8", RUNS, ids=[f"{c}-{'fn' if f == FN else 'fnuz'}" for c, f in RUNS])
def test_quantised_moe_generation_through_the_aiter_lowering(checkpoints, case, fp8, tmp_path, monkeypatch):
    name, dtype, shuffled, _ = CASES[case]
    mxfp4 = shuffled == "mxfp4_shuffled"
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    kw = dict(model=str(checkpoints(name)), dtype=dtype, device="cpu", block_size=128, cache_dir=str(tmp_path),
              disabled_passes=[] if mxfp4 else FP8_FUSIONS)  # fmt: skip

    def generate(**extra):
        llm = LLM(config=EngineConfig().update(**kw, **extra))
        return llm, [o.outputs[0] for o in llm.generate(PROMPTS, params)]

    plain, want = generate(enforce_eager=True)  # the CPU reference run
    assert experts_of(plain)[1].weight_format == shuffled.removesuffix("_shuffled")
    with monkeypatch.context() as mp:
        rocm_with_aiter(mp, fp8)
        llm, got = generate()
        layer, method = experts_of(llm)
        assert method.weight_format == shuffled
        if not mxfp4:
            assert getattr(layer, method.params[0]).dtype == fp8  # moved to the GPU's e4m3 at load
        assert "fused_moe" in fake_aiter.CALLS
        eager_llm, eager = generate(enforce_eager=True)  # the reference on the AITER layout
        tok = plain.get_tokenizer()
        prompts = [tok.encode(p) for p in PROMPTS]
        if not mxfp4:  # against AITER's math; near-ties judged on that model's logits
            with w8a8_experts(fp8, 128 if shuffled == "fp8_block_shuffled" else 0):
                _, w8a8 = generate(enforce_eager=True)
                assert_close_runs(got, w8a8, prompts, model_logits(eager_llm.engine.runner.model))
    for g, e, w in zip(got, eager, want, strict=True):
        assert len(g.token_ids) == 12
        if not mxfp4:
            assert e.token_ids == w.token_ids
    if mxfp4:
        logits_of = model_logits(plain.engine.runner.model)
        assert_close_runs(got, want, prompts, logits_of)
        assert_close_runs(eager, want, prompts, logits_of)


LOGPROB_TOL = 0.15  # measured at most 0.09 (FP8 against W8A8 experts, MI300) and 0.02 (MXFP4)


def assert_close_runs(got, want, prompts, logits_of):
    """Greedy tokens agree up to a near-tie of `logits_of` (HALF_MARGIN); the chosen tokens' logprobs
    on the steps before any parting within LOGPROB_TOL (a wiring error moves them by 1 or more)."""
    for g, w, ids in zip(got, want, prompts, strict=True):
        assert_greedy_agree(g.token_ids, w.token_ids, ids, logits_of, margin=HALF_MARGIN)
        pairs = zip(g.token_ids, w.token_ids, strict=True)
        shared = next((i for i, (a, b) in enumerate(pairs) if a != b), len(w.token_ids))
        for step in range(shared):
            token = w.token_ids[step]
            assert abs(g.logprobs[step][token] - w.logprobs[step][token]) < LOGPROB_TOL, (ids, step)
