"""`--kv-cache-dtype fp8` end to end on the tiny random-weight Llama (fp32 weights, CPU reference).

Tolerance: e4m3 keeps 3 mantissa bits, so each cached K/V value is off by up to 2^-4 relative; on
this model that moves the logprobs of the top tokens by up to ~0.1 (measured: 0.03-0.10 over the
five prompts), far more than the fp32 rounding tests/greedy.py's MARGIN is for. So the greedy
tokens of the FP8 cache must equal the fp32 cache's up to a step where the fp32 reference's two
best logits are within FP8_MARGIN (0.25) of each other, and the shared steps' logprobs must agree
to 0.2. A broken quantisation (a scale applied twice, or not at all on one side) moves logits by
whole units and fails both.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from atomc import LLM, SamplingParams
from atomc.kv_spec import PagedAttentionSpec, kv_cache_torch_dtype
from atomc.runtime.fp8_kv import check_fp8_kv_supported
from atomc.runtime.kv_cache import bytes_per_block
from models.loader import load_model
from tests.engine.helpers import PROMPTS, assert_pool_free, make
from tests.greedy import assert_outputs_close

FP8_MARGIN = 0.25
GREEDY = SamplingParams(temperature=0, max_tokens=32, logprobs=3)


@pytest.fixture(scope="module")
def fp32_run(llama_dir):
    llm = make(llama_dir)
    return llm, llm.generate(PROMPTS, GREEDY)


def assert_close_to_fp32_kv(outs, fp32_run) -> None:
    llm, want = fp32_run
    assert_outputs_close(outs, want, llm, PROMPTS, margin=FP8_MARGIN, logprob_tol=0.2)


def test_fp8_kv_cache_agrees_with_fp32_and_holds_four_times_the_blocks(llama_dir, fp32_run):
    llm = make(llama_dir, kv_cache_dtype="fp8")
    runner = llm.engine.runner
    assert all(k.dtype == torch.float8_e4m3fn and v.dtype == torch.float8_e4m3fn for k, v in runner.kv_caches)
    assert [(float(k), float(v)) for k, v in runner.kv_scales] == [(1.0, 1.0)] * len(runner.kv_caches)  # none shipped
    # the same CPU budget: 1 byte an element against fp32's 4 (against bf16's 2: twice the blocks)
    assert llm.engine.stats()["num_total_blocks"] == 4 * fp32_run[0].engine.stats()["num_total_blocks"]
    assert_close_to_fp32_kv(llm.generate(PROMPTS, GREEDY), fp32_run)
    assert_pool_free(llm)


def test_fp8_block_bytes_are_half_of_bf16():
    specs = [PagedAttentionSpec(8, 128)] * 32  # Llama-3.1-8B
    fp8, bf16 = (bytes_per_block(specs, 16, kv_cache_torch_dtype(n, torch.bfloat16)) for n in ("fp8", "auto"))
    assert bf16 == 2 * fp8 == 2 * 32 * 2 * 8 * 128 * 16


def with_kv_scales(llama_dir, tmp_path, tensors: dict[str, torch.Tensor]):
    """The tiny checkpoint plus extra tensors (KV scales under their writers' names)."""
    out = tmp_path / "with_scales"
    shutil.copytree(llama_dir, out)
    (shard,) = out.glob("*.safetensors")
    weights = load_file(shard)
    save_file({**weights, **tensors}, shard, metadata={"format": "pt"})
    return out


def test_checkpoint_kv_scales_are_loaded_and_used(llama_dir, tmp_path, fp32_run):
    """Layer 0 ships `self_attn.k_scale` / `v_scale` (HF, compressed-tensors), layer 1 the older
    `k_proj.output_scale` / `v_proj.output_scale`; the runner hands them to the kernels, and the
    tokens stay the fp32 cache's (scales of 2^-5 and 2^-4 keep this model's K/V inside ±448)."""
    path = with_kv_scales(
        llama_dir,
        tmp_path,
        {
            "model.layers.0.self_attn.k_scale": torch.tensor(2.0**-5),
            "model.layers.0.self_attn.v_scale": torch.tensor(2.0**-4),
            "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([2.0**-4]),
            "model.layers.1.self_attn.v_proj.output_scale": torch.tensor([2.0**-5]),
        },
    )
    llm = make(path, kv_cache_dtype="fp8_e4m3")
    scales = [(float(k), float(v)) for k, v in llm.engine.runner.kv_scales]
    assert scales == [(2.0**-5, 2.0**-4), (2.0**-4, 2.0**-5)]
    assert_close_to_fp32_kv(llm.generate(PROMPTS, GREEDY), fp32_run)
    # without --kv-cache-dtype fp8 the scales are read and left unused: the pages are the model's dtype
    plain = load_model(path, torch.float32, "cpu")
    assert plain.kv_cache_scales == {0: {"k": 2.0**-5, "v": 2.0**-4}, 1: {"k": 2.0**-4, "v": 2.0**-5}}


def test_compiled_engine_reads_and_writes_fp8_pages(llama_dir, tmp_path, fp32_run):
    """The compiled graph (fused RoPE + KV write, then paged attention: the ops a GPU runs) with
    checkpoint scales: the fp32 cache's tokens, as the eager FP8 engine gives them."""
    scales = {f"model.layers.{i}.self_attn.{w}_scale": torch.tensor(2.0**-5) for i in (0, 1) for w in "kv"}
    path = with_kv_scales(llama_dir, tmp_path, scales)
    llm = LLM(model=str(path), dtype="float32", device="cpu", kv_cache_dtype="fp8", cache_dir=str(tmp_path / "c"))
    assert llm.engine.runner.compile_info["key"]
    assert_close_to_fp32_kv(llm.generate(PROMPTS, GREEDY), fp32_run)


def test_bad_checkpoint_kv_scales_name_the_tensor(llama_dir, tmp_path):
    path = with_kv_scales(llama_dir, tmp_path, {"model.layers.0.self_attn.k_scale": torch.ones(2)})
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_scale has shape \(2,\): only per-tensor"):
        load_model(path, torch.float32, "cpu")
    shutil.rmtree(path)
    path = with_kv_scales(llama_dir, tmp_path, {"model.layers.0.self_attn.kv_scale": torch.tensor(0.0)})
    with pytest.raises(ValueError, match="kv_scale is 0.0: a KV-cache scale must be positive"):
        load_model(path, torch.float32, "cpu")
    shutil.rmtree(path)
    path = with_kv_scales(llama_dir, tmp_path, {"model.norm.k_scale": torch.tensor(1.0)})  # no attention layer
    with pytest.raises(ValueError, match="unexpected: model.norm.k_scale"):
        load_model(path, torch.float32, "cpu")


def test_unsupported_fp8_kv_configs_are_refused():
    with pytest.raises(ValueError, match="fp8_e5m2 is not supported"):
        kv_cache_torch_dtype("fp8_e5m2", torch.bfloat16)
    with pytest.raises(ValueError, match="'int8' is not one of"):
        kv_cache_torch_dtype("int8", torch.bfloat16)
    with pytest.raises(ValueError, match="not supported on ROCm"):
        check_fp8_kv_supported([PagedAttentionSpec(8, 128)], "cuda", "rocm")
    check_fp8_kv_supported([PagedAttentionSpec(8, 128)], "cpu", "cpu")
