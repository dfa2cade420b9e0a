"""A whole generation through the ROCm lowering on CPU: the stand-in `aiter` installed as `aiter`,
the "rocm" pass pipeline forced, Triton marked unavailable (so every op AITER covers runs on the
stand-in and the rest on the torch reference), and a tiny Llama, Mistral (sliding window) or
Qwen3-MoE compiled. Its greedy tokens must equal the eager torch-reference engine's. This checks
the wiring (lowering, argument names, layouts, metadata), not AMD hardware: none of the AITER path
has run there."""

from __future__ import annotations

import fake_aiter
import pytest

from atomc import LLM, SamplingParams
from atomc.kernels import registry

PROMPTS = ["The capital of France is", "Once upon a time there", "def add(a, b):\n"]


@pytest.fixture
def rocm_pipeline(monkeypatch):
    from atomc.passes.manager import PassManager

    fake_aiter.install(monkeypatch)
    monkeypatch.setattr(registry, "backend_available", lambda backend: backend != "triton")
    for_platform = PassManager.for_platform.__func__
    rocm = classmethod(lambda cls, platform, disabled=(): for_platform(cls, "rocm", disabled))
    monkeypatch.setattr(PassManager, "for_platform", rocm)  # the pipeline the build asks for, on "cpu"
    fake_aiter.CALLS.clear()


@pytest.fixture(scope="module")
def mistral_window_dir(tmp_path_factory):
    """Mistral with a 6-token sliding window: prompts and generations run past it."""
    from tests.conftest import FAMILIES, build_checkpoint

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(FAMILIES, "mistral_w6", dict(FAMILIES["mistral"], sliding_window=6))
        return build_checkpoint("mistral_w6", tmp_path_factory.mktemp("mistral_w6"))


ATTENTION_CALLS = {"flash_attn_varlen_func", "paged_attention_v1", "reshape_and_cache_flash", "rmsnorm2d_fwd_with_add",
                   "rope_cached_positions_2c_fwd"}  # fmt: skip
# the MoE block on AITER: its router through topk_softmax, its experts through fused_moe
MODELS = {
    "llama": ("llama_dir", ATTENTION_CALLS | {"silu_and_mul"}),
    "mistral_window": ("mistral_window_dir", ATTENTION_CALLS | {"silu_and_mul"}),
    "qwen3_moe": ("qwen3_moe_dir", ATTENTION_CALLS | {"topk_softmax", "fused_moe"}),
}


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    """Qwen3-MoE (8 experts, top-2, renormalised; q/k norms), every layer sparse."""
    from tests.conftest import build_checkpoint

    return build_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


@pytest.mark.parametrize("model", list(MODELS))
def test_generation_through_the_aiter_lowering(rocm_pipeline, model, request, tmp_path):
    fixture, expected_calls = MODELS[model]
    model_dir = request.getfixturevalue(fixture)
    # fp16: AITER's attention takes fp16/bf16 only; 128-token pages: CK's paged prefill needs them
    kw = dict(model=str(model_dir), dtype="float16", device="cpu", block_size=128, cache_dir=str(tmp_path))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(**kw)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    chosen = llm.engine.runner.compile_info.get("passes", {})
    calls = set(fake_aiter.CALLS)
    assert expected_calls <= calls, (calls, chosen)
    want = [o.outputs[0].token_ids for o in LLM(**kw, enforce_eager=True).generate(PROMPTS, params)]
    assert got == want
    assert len(got[0]) == 12
