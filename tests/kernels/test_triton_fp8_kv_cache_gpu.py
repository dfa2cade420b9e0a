"""The FP8 (e4m3) KV cache on a GPU (sm_89+): the Triton KV writes and paged attention at
Llama-3.1-8B shapes (32 query heads, 8 KV heads, head dim 128, 16-token pages) in bf16, against
the torch reference; decode replayed from a CUDA graph; and the engine on the tiny Llama, eager and
with CUDA graphs, against its bf16 KV cache. Skips without CUDA.

Tolerances: the writes divide in fp32 (Triton's division may be the 2-ulp approximate one) and
round with the hardware's cast, nearest even: at most 0.1% of the stored values one e4m3 step
from the reference's. Attention reads the same stored bytes as the reference and computes in
bf16 dots with fp32 accumulation: ‖out − ref‖/‖ref‖ < 1e-2 (bf16 alone is ~4e-3). Against the
unquantised K/V the error is e4m3's, < 6%. The engine: tests/engine/test_fp8_kv_cache.py's rule.
"""

import gc

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from triton_kernel_cases import ATTN_CASES, attention_reference, cos_sin_cache, make_batch, rel_err  # noqa: E402

from atomc.ops.attention import dequantize_kv, quantize_kv  # noqa: E402
from atomc.ops.attention import write_kv_cache as write_reference  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn
HQ, HKV, D = 32, 8, 128  # Llama-3.1-8B


@pytest.fixture(autouse=True)
def _sm89():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 needs sm_89+")


def scales():
    return torch.tensor([0.03], device=DEV), torch.tensor([0.025], device=DEV)


def reference_pages(k, v, slots, kv_scales, shape):
    """The reference write, on the CPU (no fp8 index_put of torch's needed on the GPU)."""
    pages = [torch.zeros(shape, dtype=FP8) for _ in range(2)]
    write_reference(k.cpu(), v.cpu(), *pages, slots.cpu(), tuple(s.cpu() for s in kv_scales))
    return pages


def few_flips(q, q_ref, frac=1e-3):
    a, b = q.float().cpu(), q_ref.float().cpu()
    diff = (a - b).abs()
    assert (diff > 0).float().mean().item() <= frac
    assert (diff <= 0.125 * torch.maximum(a.abs(), b.abs()) + 2**-9).all()


def fp8_batch(q_lens, seq_lens):
    q, k_vals, v_vals, meta = make_batch(q_lens, seq_lens, HQ, HKV, D, torch.float32, DEV)
    kv_scales = scales()
    k_vals, v_vals = k_vals * 2, v_vals * 2
    k_cache, v_cache = quantize_kv(k_vals, FP8, kv_scales[0]), quantize_kv(v_vals, FP8, kv_scales[1])
    return q.to(BF16), k_cache, v_cache, meta, kv_scales, (k_vals, v_vals)


@pytest.mark.parametrize("num_segments", [1, None])
@pytest.mark.parametrize("case", list(ATTN_CASES) + ["long_decode"])
def test_paged_attention_fp8_at_8b_shapes(case, num_segments):
    from atomc.kernels.triton import paged_attention

    q_lens, seq_lens = ATTN_CASES.get(case, ([1] * 4, [1000, 4096, 37, 2500]))
    q, k_cache, v_cache, meta, kv_scales, (k_vals, v_vals) = fp8_batch(q_lens, seq_lens)
    scale = D**-0.5
    out = torch.full_like(q, float("nan"))
    paged_attention(
        q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
        meta.max_query_len, meta.max_seq_len, meta.num_seqs, num_segments=num_segments, kv_scales=kv_scales,
    )  # fmt: skip
    t = meta.query_start_loc_host[-1]
    # the reference's FP8 read is attention over the dequantised pages (tested on the CPU), taken
    # that way here so that no fp8 indexing kernel of torch's is needed on the GPU
    k_deq, v_deq = dequantize_kv(k_cache, kv_scales[0]), dequantize_kv(v_cache, kv_scales[1])
    ref = attention_reference(q, k_deq, v_deq, meta, scale)
    assert not out[:t].isnan().any()
    assert rel_err(out[:t], ref[:t]) < 1e-2
    assert rel_err(out[:t], attention_reference(q, k_vals, v_vals, meta, scale)[:t]) < 0.06


def test_kv_writes_fp8_at_8b_shapes():
    from atomc.kernels.triton import rope_and_write_kv, write_kv_cache

    g = torch.Generator(DEV).manual_seed(3)
    t = 64
    q = torch.randn(t, HQ, D, generator=g, device=DEV).to(BF16)
    k = (torch.randn(t, HKV, D, generator=g, device=DEV) * 2).to(BF16)
    v = (torch.randn(t, HKV, D, generator=g, device=DEV) * 2).to(BF16)
    slots = torch.randperm(40 * 16, generator=g, device=DEV)[:t]
    slots[::7] = -1
    kv_scales = scales()
    shape = (40, 16, HKV, D)
    pages = [torch.zeros(shape, dtype=FP8, device=DEV) for _ in range(2)]
    write_kv_cache(k, v, *pages, slots, kv_scales)
    for got, want in zip(pages, reference_pages(k, v, slots, kv_scales, shape), strict=True):
        few_flips(got, want)
    positions = torch.arange(t, device=DEV)
    for p in pages:
        p.zero_()
    _, k_rot = rope_and_write_kv(
        positions, q.clone(), k.clone(), v, cos_sin_cache(128, D, DEV), *pages, slots, kv_scales=kv_scales
    )
    for got, want in zip(pages, reference_pages(k_rot, v, slots, kv_scales, shape), strict=True):
        few_flips(got, want)
    assert dequantize_kv(pages[1], kv_scales[1]).abs().max() > 1  # real values were written


def test_fp8_decode_replays_in_a_cuda_graph():
    from atomc.kernels.triton import paged_attention

    q, k_cache, v_cache, meta, kv_scales, _ = fp8_batch([1] * 8, [300, 17, 4096, 1000, 64, 65, 2000, 1])
    out = torch.zeros_like(q)

    def step():
        paged_attention(
            q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, D**-0.5,
            1, 4096, 8, kv_scales=kv_scales,
        )  # fmt: skip

    step()
    torch.cuda.synchronize()
    want = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out.zero_()
    kv_scales[1].mul_(2)  # the graph reads the scale tensor at replay: a new v_scale doubles the output
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), want.float() * 2, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cudagraphs"])
def test_gpu_engine_fp8_kv_agrees_with_bf16_kv(checkpoints, enforce_eager):
    from atomc import LLM, SamplingParams
    from models.loader import load_model
    from tests.engine.test_fp8_kv_cache import FP8_MARGIN, PROMPTS
    from tests.greedy import assert_greedy_agree, model_logits

    d = str(checkpoints["llama"])
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    kw = dict(model=d, dtype="bfloat16", device="cuda", enforce_eager=enforce_eager, max_num_seqs=8)
    runs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(**kw, kv_cache_dtype=kv)
        runs[kv] = (llm.engine.runner.num_blocks, llm.generate(PROMPTS, params))
        if kv == "fp8":
            assert llm.engine.runner.kv_caches[0][0].dtype == FP8
        del llm
        gc.collect()  # the first engine's pages must be gone before the second sizes its pool
        torch.cuda.empty_cache()
    # the same memory budget (weights are tiny): about twice the blocks
    assert runs["fp8"][0] >= 1.9 * runs["auto"][0]
    logits_of = model_logits(load_model(checkpoints["llama"], torch.float32, "cpu"))
    for got, want in zip(runs["fp8"][1], runs["auto"][1], strict=True):
        assert_greedy_agree(
            got.outputs[0].token_ids, want.outputs[0].token_ids, want.prompt_token_ids, logits_of, margin=FP8_MARGIN
        )
