"""`--kv-cache-dtype fp8` end to end on the tiny random-weight DeepSeek-V2 and V3 (MLA: the latent
cache [c_kv | k_pe] in e4m3, one scale a layer; fp32 weights, CPU reference).

The rule is tests/engine/test_fp8_kv_cache.py's: the greedy tokens of the FP8 cache must equal the
fp32 cache's up to a step where the fp32 reference's two best logits are within FP8_MARGIN (0.25) of
each other, and the shared steps' logprobs must agree to LOGPROB_TOL. Why the bound holds: e4m3
keeps 3 mantissa bits, so each cached latent value is off by up to 2^-4 relative (these models'
latents sit between about 2^-6 and 4, no subnormal loss to speak of, far from ±448 at scale 1.0);
that reaches the logits through the scores (every head's key is the whole row) and the values (the
c_kv part). Measured over the five prompts: logprob moves of 0.001-0.09 on nearly every shared step
(V2 at most 0.04), the worst 0.215 (V3, one step where the fp32 top-2 gap is 0.12; V3's YaRN mscale
sharpens its softmax, so score errors weigh more). LOGPROB_TOL is 0.3, above that, where the MHA
test uses 0.2. A scale skipped or applied twice on one side multiplies the scores (and the values)
by it, 8 or 16 with the checkpoint scales below, and moves the logits by whole units: both checks fail.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from atomc import LLM, SamplingParams
from atomc.kv_spec import MLAAttentionSpec, PagedAttentionSpec, kv_cache_torch_dtype
from atomc.runtime.fp8_kv import check_fp8_kv_supported
from atomc.runtime.kv_cache import bytes_per_block
from tests.engine.helpers import PROMPTS, assert_pool_free, make
from tests.greedy import assert_outputs_close

FP8_MARGIN = 0.25
LOGPROB_TOL = 0.3
GREEDY = SamplingParams(temperature=0, max_tokens=24, logprobs=3, ignore_eos=True)
FAMILIES = ["deepseek_v2", "deepseek_v3"]


@pytest.fixture(scope="module", params=FAMILIES)
def fp32_run(request, checkpoints):
    """(checkpoint, the engine with an fp32 latent cache, its greedy outputs) of one family."""
    llm = make(checkpoints[request.param])
    return checkpoints[request.param], llm, llm.generate(PROMPTS, GREEDY)


def assert_close_to_fp32_kv(outs, fp32_run) -> None:
    """The rule of the module docstring."""
    _, llm, want = fp32_run
    assert_outputs_close(outs, want, llm, PROMPTS, margin=FP8_MARGIN, logprob_tol=LOGPROB_TOL)


def test_fp8_latent_cache_agrees_with_fp32_and_holds_four_times_the_blocks(fp32_run):
    model_dir, fp32_llm, _ = fp32_run
    llm = make(model_dir, kv_cache_dtype="fp8")
    runner = llm.engine.runner
    assert all(c.dtype == torch.float8_e4m3fn for c, _ in runner.kv_caches)
    # one scale a layer, the same tensor for the "k" and "v" halves of the pair (none shipped: 1.0)
    assert all(k is v and float(k) == 1.0 for k, v in runner.kv_scales)
    # the same CPU budget: 1 byte a latent value against fp32's 4 (against bf16's 2: twice the blocks)
    assert llm.engine.stats()["num_total_blocks"] == 4 * fp32_llm.engine.stats()["num_total_blocks"]
    assert_close_to_fp32_kv(llm.generate(PROMPTS, GREEDY), fp32_run)
    assert_pool_free(llm)


def with_kv_scales(model_dir, tmp_path, tensors: dict[str, torch.Tensor]):
    out = tmp_path / "with_scales"
    shutil.copytree(model_dir, out)
    (shard,) = out.glob("*.safetensors")
    save_file({**load_file(shard), **tensors}, shard, metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("fp32_run", ["deepseek_v3"], indirect=True)  # the compile takes ~15 s: one family
def test_compiled_engine_with_checkpoint_latent_scales(fp32_run, tmp_path):
    """The compiled graph (the fused latent norm + RoPE, then atomc::mla_attention, which writes
    and reads the FP8 pages) with the checkpoint's scales: layer 0 ships `self_attn.k_scale` (and a
    v_scale, which an MLA layer does not use), layer 1 the single `self_attn.kv_scale`, layer 2
    vLLM's module-tree name `self_attn.mla_attn.k_scale`. Tokens and logprobs as the fp32 cache's."""
    path = with_kv_scales(
        fp32_run[0],
        tmp_path,
        {
            "model.layers.0.self_attn.k_scale": torch.tensor(2.0**-4),
            "model.layers.0.self_attn.v_scale": torch.tensor(8.0),
            "model.layers.1.self_attn.kv_scale": torch.tensor([2.0**-3]),
            "model.layers.2.self_attn.mla_attn.k_scale": torch.tensor(2.0**-5),
        },
    )
    llm = LLM(model=str(path), dtype="float32", device="cpu", kv_cache_dtype="fp8", cache_dir=str(tmp_path / "c"))
    assert llm.engine.runner.compile_info["key"]
    assert [float(k) for k, _ in llm.engine.runner.kv_scales] == [2.0**-4, 2.0**-3, 2.0**-5]
    assert_close_to_fp32_kv(llm.generate(PROMPTS, GREEDY), fp32_run)


def test_fp8_latent_block_bytes_are_half_of_bf16():
    specs = [MLAAttentionSpec(512, 64)] * 61  # DeepSeek-V3: 576 values a token a layer
    fp8, bf16 = (bytes_per_block(specs, 64, kv_cache_torch_dtype(n, torch.bfloat16)) for n in ("fp8", "auto"))
    assert bf16 == 2 * fp8 == 2 * 61 * 576 * 64


def test_mla_fp8_kv_is_refused_on_rocm_only():
    check_fp8_kv_supported([MLAAttentionSpec(512, 64)], "cpu", "cpu")
    with pytest.raises(ValueError, match="not supported for MLA models .* on ROCm"):
        check_fp8_kv_supported([MLAAttentionSpec(512, 64)], "cuda", "rocm")
    with pytest.raises(ValueError, match="not supported on ROCm"):
        check_fp8_kv_supported([PagedAttentionSpec(8, 128)], "cuda", "rocm")


def test_prefix_hit_and_chunked_prefill_over_fp8_latent_pages(checkpoints):
    """A prefix hit reads the FP8 rows an earlier request wrote, and 8-token chunks attend over the
    FP8 rows of the chunks before: both give a cold FP8 run's tokens (every path reads the same
    stored bytes, so no tolerance beyond fp32 summation order)."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(kv_cache_dtype="fp8", block_size=4, num_kv_blocks=128)
    llm = make(checkpoints["deepseek_v2"], **kw)
    tok = llm.get_tokenizer()
    first = tok(PROMPTS[1]).input_ids
    second = first + tok(" and then a second question came.").input_ids
    llm.generate([{"prompt_token_ids": first}], params)
    hit = llm.generate([{"prompt_token_ids": second}], params)[0]
    assert hit.num_cached_tokens == len(first) // 4 * 4 > 8
    cold = make(checkpoints["deepseek_v2"], enable_prefix_caching=False, **kw)
    chunked = make(checkpoints["deepseek_v2"], enable_prefix_caching=False, max_num_batched_tokens=8, **kw)
    want = cold.generate([{"prompt_token_ids": second}], params)[0].outputs[0].token_ids
    assert hit.outputs[0].token_ids == want
    assert chunked.generate([{"prompt_token_ids": second}], params)[0].outputs[0].token_ids == want
