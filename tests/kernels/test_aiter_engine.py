"""A whole generation through the ROCm lowering on CPU: the stand-in `aiter` installed as `aiter`,
the "rocm" pass pipeline forced, Triton marked unavailable (so every op AITER covers runs on the
stand-in and the rest on the torch reference), and a tiny Llama, Mistral (sliding window),
Qwen3-MoE or DeepSeek-V2/V3 (MLA at the widths AITER's MLA kernels take) compiled. Its greedy
tokens must equal the eager torch-reference engine's. This checks the wiring (lowering, argument
names, layouts, metadata), not AMD hardware: none of the AITER path has run there."""

from __future__ import annotations

import fake_aiter
import pytest

from atomc import LLM, SamplingParams
from atomc.kernels import registry
from tests.greedy import assert_greedy_agree, model_logits

# the runs are fp16/bf16 (what AITER takes), so the two computations' logits differ by a few units in
# the last place of a logit of a few units (bf16: 2^-6 at 2-4) and may part at a near-tie
HALF_MARGIN = 0.1
PROMPTS = ["The capital of France is", "Once upon a time there", "def add(a, b):\n"]


@pytest.fixture
def rocm_pipeline(monkeypatch):
    from atomc.passes.manager import PassManager

    fake_aiter.install(monkeypatch)
    monkeypatch.setattr(registry, "backend_available", lambda backend: backend != "triton")
    for_platform = PassManager.for_platform.__func__
    rocm = classmethod(lambda cls, platform, disabled=(), **kw: for_platform(cls, "rocm", disabled, **kw))
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
MLA_CALLS = {"concat_and_cache_mla", "mla_prefill_fwd", "mla_decode_fwd", "rmsnorm2d_fwd", "fused_moe"}
MODELS = {  # model -> (checkpoint fixture, AITER calls it must make, dtype, page size)
    # fp16: AITER's attention takes fp16/bf16 only; 128-token pages: CK's paged prefill needs them
    "llama": ("llama_dir", ATTENTION_CALLS | {"silu_and_mul"}, "float16", 128),
    "mistral_window": ("mistral_window_dir", ATTENTION_CALLS | {"silu_and_mul"}, "float16", 128),
    "qwen3_moe": ("qwen3_moe_dir", ATTENTION_CALLS | {"topk_softmax", "fused_moe"}, "float16", 128),
    # bf16: AITER's MLA kernels take bf16 only; any page size (they read the latent as 1-token pages).
    # V3 routes through biased_grouped_topk, V2 with group-limited routing through grouped_topk
    "deepseek_v3": ("deepseek_v3_mla_dir", MLA_CALLS | {"biased_grouped_topk", "silu_and_mul"}, "bfloat16", 16),
    "deepseek_v2": ("deepseek_v2_mla_dir", MLA_CALLS | {"grouped_topk"}, "bfloat16", 16),
}


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    """Qwen3-MoE (8 experts, top-2, renormalised; q/k norms), every layer sparse."""
    from tests.conftest import build_checkpoint

    return build_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


# what AITER's MLA kernels are built for: 16 (or 128) heads, kv_lora 512, rope 64
AITER_MLA = dict(num_attention_heads=16, kv_lora_rank=512, qk_rope_head_dim=64)


def deepseek_dir(tmp_path_factory, family: str, **extra):
    from tests.conftest import FAMILIES, build_checkpoint

    name = f"{family}_aiter_mla"
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(FAMILIES, name, dict(FAMILIES[family], **AITER_MLA, **extra))
        return build_checkpoint(name, tmp_path_factory.mktemp(name))


@pytest.fixture(scope="module")
def deepseek_v3_mla_dir(tmp_path_factory):
    """V3: q LoRA, sigmoid + correction bias + 4 groups of which 2 kept, a dense first layer, YaRN."""
    return deepseek_dir(tmp_path_factory, "deepseek_v3")


@pytest.fixture(scope="module")
def deepseek_v2_mla_dir(tmp_path_factory):
    """V2: no q LoRA, softmax scores, group-limited routing (one group of four kept)."""
    return deepseek_dir(tmp_path_factory, "deepseek_v2", topk_method="group_limited_greedy", n_group=4, topk_group=1)


@pytest.mark.parametrize("model", list(MODELS))
def test_generation_through_the_aiter_lowering(rocm_pipeline, model, request, tmp_path):
    fixture, expected_calls, dtype, page = MODELS[model]
    model_dir = request.getfixturevalue(fixture)
    kw = dict(model=str(model_dir), dtype=dtype, device="cpu", block_size=page, cache_dir=str(tmp_path))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(**kw)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    chosen = llm.engine.runner.compile_info.get("passes", {})
    calls = set(fake_aiter.CALLS)
    assert expected_calls <= calls, (calls, chosen)
    ref = LLM(**kw, enforce_eager=True)
    want = ref.generate(PROMPTS, params)
    logits_of = model_logits(ref.engine.runner.model)
    for g, w in zip(got, want, strict=True):
        assert_greedy_agree(g, w.outputs[0].token_ids, w.prompt_token_ids, logits_of, margin=HALF_MARGIN)
    assert len(got[0]) == 12
