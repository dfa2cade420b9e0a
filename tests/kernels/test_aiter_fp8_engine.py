"""FP8 Llamas through the ROCm lowering on CPU, as test_aiter_engine.py runs the bf16 families: the
stand-in `aiter` installed, the "rocm" pass pipeline forced, Triton marked unavailable, and the GPU
either an MI350 (float8_e4m3fn) or an MI300 (float8_e4m3fnuz: the weights move to fnuz at load and
AITER's kernels quantise into it). Each format's compiled generation must make the AITER FP8 calls
it is built for and give the greedy tokens of the eager engine on the same platform (the reference
ops, reading the same weights by value). Each runs twice: with the weights laid out as the loader
lays them out on a ROCm GPU that runs AITER (pre-shuffled: AITER's gemm_a8w8_bpreshuffle and
gemm_a8w8_blockscale_bpreshuffle; the eager run's references unshuffle them), and row-major (the
layout of layers those GEMMs do not take: gemm_a8w8 and gemm_a8w8_blockscale). This checks the
wiring, not AMD hardware: none of the AITER path has run there.

Why tokens can be compared exactly: the stand-in's quants are atomc's arithmetic (amax / max, x /
scale, round to e4m3). On MI300 they round onto fnuz's grid at amax / 240, which is not fn's grid at
amax / 448 (the top values' mantissas differ: 1.875 vs 1.75 times a power of two), so the two differ
by a quantisation error (measured 8-14% of the largest logit, dynamic scales; static ones, doubled
at load, give the same values): the eager reference is pointed at fnuz for the comparison
(`aiter_grid`: atomc.ops.fp8's FP8_DTYPE and FP8_MAX), and quantises as AITER does.
One difference remains: AITER's fused RMSNorm and SiLU·mul quants (as their source reads) quantise
the fp32 intermediate, where atomc's reference rounds it to fp16 first, so a value within fp16
rounding of an e4m3 boundary lands on the other side (one e4m3 step, 2^-3 of the value). On the
per-token Llama of "online" the tokens still agree on MI350 (on MI300 they part at the 10th token);
the 128-wide block model is that sensitive (measured: max logit difference 0.18-0.34 of ~3 from that
rounding alone, 0.0 without the fusions). Those runs have the two FP8 fusion passes off, which
checks the GEMMs and the plain quants exactly; the fused kernels run in the MI350 "online" case and
their numbers are checked op by op, on both GPUs (test_aiter_fp8.py).
"""

from __future__ import annotations

import contextlib

import fake_aiter
import pytest
import torch

from atomc import LLM, SamplingParams, platforms
from atomc.config import EngineConfig
from atomc.kernels import registry
from atomc.ops import fp8 as fp8_ops
from tests.quant import fp8_checkpoints as fc

PROMPTS = ["The capital of France is", "Once upon a time there", "def add(a, b):\n"]
FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz


@pytest.fixture(params=[FN, FNUZ], ids=["mi350-fn", "mi300-fnuz"])
def rocm_fp8(request, monkeypatch):
    from atomc.passes.manager import PassManager

    fake_aiter.install(monkeypatch, fp8=request.param)
    monkeypatch.setattr(registry, "backend_available", lambda backend: backend != "triton")
    monkeypatch.setattr(platforms, "fp8_dtype", lambda device: request.param)  # the GPU's e4m3 at load
    for_platform = PassManager.for_platform.__func__
    rocm = classmethod(lambda cls, platform, disabled=(), **kw: for_platform(cls, "rocm", disabled, **kw))
    monkeypatch.setattr(PassManager, "for_platform", rocm)
    fake_aiter.CALLS.clear()
    return request.param


@contextlib.contextmanager
def aiter_grid(dtype):
    """atomc's reference quants writing `dtype` at amax / its max, as AITER's do (module docstring)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fp8_ops, "FP8_DTYPE", dtype)
        mp.setattr(fp8_ops, "FP8_MAX", torch.finfo(dtype).max)
        yield


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("aiter-fp8"), {}

    def get(name):
        if name not in made:
            if name == "online":
                made[name] = (fc.base_checkpoint(root / "base"), "fp8")
            elif name == "static":
                made[name] = (fc.write_hf_fp8(get("online")[0], root / "static", "static"), None)
            else:  # block 128 x 128, on the base whose sections are whole blocks
                wide = fc.base_checkpoint(root / "wide", wide=True)
                made[name] = (fc.write_hf_fp8(wide, root / "block", "block"), None)
        return made[name]

    return get


GEMM_CALLS = {"gemm_a8w8"}
CASES = {  # checkpoint -> the AITER calls its compiled run must make
    # --quantization fp8: per-row weights, per-token activations, the quants fused into RMSNorm and
    # SiLU·mul (unfused on MI300: module docstring)
    "online": GEMM_CALLS | {"rmsnorm2d_fwd_with_add_dynamicquant", "silu_and_mul_quant"},
    # static per-tensor input scales: AITER's RMSNorm / SiLU·mul, then its static quant
    "static": GEMM_CALLS | {"rmsnorm2d_fwd_with_add", "silu_and_mul", "static_per_tensor_quant"},
    # DeepSeek-style blocks, unfused (module docstring): per-token (K = 128) and group-128 quants, block GEMM
    "block": {"gemm_a8w8_blockscale", "per_token_quant_hip", "per_group_quant_hip"},
}
FP8_FUSIONS = ["fuse_rmsnorm_fp8_quant", "fuse_silu_mul_fp8_quant"]
UNFUSED = {("block", FN), ("block", FNUZ), ("online", FNUZ)}  # run without FP8_FUSIONS (module docstring)
UNFUSED_CALLS = GEMM_CALLS | {"per_token_quant_hip"}


# the layout the loader writes on a ROCm GPU with AITER (models/quant/aiter.py): every linear of these
# models is pre-shuffled there, so AITER's pre-shuffled GEMMs run instead of the row-major ones
# (which run for the layers shuffle_weight does not take, the "row-major" runs here)
SHUFFLED_GEMMS = {"gemm_a8w8": "gemm_a8w8_bpreshuffle", "gemm_a8w8_blockscale": "gemm_a8w8_blockscale_bpreshuffle"}


@pytest.mark.parametrize("layout", ["shuffled", "row-major"])
@pytest.mark.parametrize("case", list(CASES))
def test_fp8_generation_through_the_aiter_lowering(rocm_fp8, checkpoints, case, layout, tmp_path, monkeypatch):
    model_dir, quantization = checkpoints(case)
    unfused = (case, rocm_fp8) in UNFUSED
    expected = UNFUSED_CALLS if (case == "online" and unfused) else CASES[case]
    monkeypatch.setattr(platforms, "uses_aiter", lambda device: layout == "shuffled")
    if layout == "shuffled":
        expected = {SHUFFLED_GEMMS.get(c, c) for c in expected}
    kw = dict(model=str(model_dir), dtype="float16", device="cpu", block_size=128, cache_dir=str(tmp_path))
    if quantization:
        kw["quantization"] = quantization

    def config(**extra):
        return EngineConfig().update(**kw, disabled_passes=FP8_FUSIONS if unfused else [], **extra)

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(config=config())
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == rocm_fp8  # moved to the GPU's e4m3 at load
    assert qkv.linear_method.shuffled == (layout == "shuffled")
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    calls = set(fake_aiter.CALLS)
    assert expected <= calls, calls
    if layout == "shuffled":  # every linear of these models pre-shuffled: no row-major GEMM left
        assert not {"gemm_a8w8", "gemm_a8w8_blockscale"} & calls, calls
    with aiter_grid(rocm_fp8):  # eager: the references, on the same (shuffled or row-major) weights
        want = [o.outputs[0].token_ids for o in LLM(config=config(enforce_eager=True)).generate(PROMPTS, params)]
    assert got == want
    assert len(got[0]) == 12
