"""RoPE, the KV write and decode attention in one launch (`paged_attention(rope=DecodeRope(...))`) on
CUDA in bf16, at Llama-3.1-8B's and Qwen3's head shapes, against the two launches it replaces (the
RoPE + write kernel, then the attention kernel), eager and replayed from a CUDA graph."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

from triton_kernel_cases import cos_sin_cache, make_batch, rel_err  # noqa: E402

from atomc.ops.attention import quantize_kv  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn
SEQ_LENS = [1, 17, 300, 2049, 4096, 33, 64, 700]


def _step(seq_lens, hq, hkv, d, fp8, qk_norm, seed=0):
    q, k_cache, v_cache, meta = make_batch([1] * len(seq_lens), seq_lens, hq, hkv, d, BF16, DEV, seed=seed)
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    t = q.shape[0]
    k = torch.randn(t, hkv, d, generator=g, device=DEV).to(BF16)
    v = torch.randn(t, hkv, d, generator=g, device=DEV).to(BF16)
    positions = torch.zeros(t, dtype=torch.int64, device=DEV)
    positions[: len(seq_lens)] = torch.tensor(seq_lens, device=DEV) - 1
    scales = None
    if fp8:
        scales = (torch.tensor([0.05], device=DEV), torch.tensor([0.04], device=DEV))
        k_cache, v_cache = (quantize_kv(x.float() * 2, FP8, s) for x, s in zip((k_cache, v_cache), scales, strict=True))
    norm = None
    if qk_norm:
        w = (1 + 0.5 * torch.randn(2, d, generator=g, device=DEV)).to(BF16)
        norm = (w[0].contiguous(), 1e-6, w[1].contiguous(), 1e-6)
    return q, k, v, positions, k_cache, v_cache, meta, scales, norm


@pytest.mark.parametrize(
    "hq,hkv,qk_norm", [(32, 8, False), (32, 4, True)], ids=["llama-3.1-8b", "qwen3-30b-a3b"]
)  # fmt: skip
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16_pages", "fp8_pages"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_one_launch_matches_the_two(hq, hkv, qk_norm, fp8, graph):
    import atomc.kernels.triton as kt
    from atomc.kernels.triton.paged_attention import DecodeRope

    d = 128
    q, k, v, positions, k_cache, v_cache, meta, scales, norm = _step(SEQ_LENS, hq, hkv, d, fp8, qk_norm)
    cs = cos_sin_cache(8192, d, DEV)
    args = (meta.query_start_loc, meta.seq_lens, meta.block_tables, d**-0.5, 1, 8192, meta.num_seqs)
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    q_rot, k_rot = torch.empty_like(q), torch.empty_like(k)
    kt.rope_and_write_kv(
        positions, q, k, v, cs, kc_ref, vc_ref, meta.slot_mapping, qk_norm=norm, kv_scales=scales, out=(q_rot, k_rot)
    )
    ref = torch.zeros_like(q)
    kt.paged_attention(q_rot, kc_ref, vc_ref, ref, *args, kv_scales=scales)

    out = torch.zeros_like(q)
    rope = DecodeRope(positions, k, v, cs, meta.slot_mapping, norm)

    def fused():
        kt.paged_attention(q, k_cache, v_cache, out, *args, kv_scales=scales, rope=rope)

    if graph:
        fused()  # compile outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fused()
        out.zero_()
        g.replay()
    else:
        fused()
    torch.cuda.synchronize()
    n = len(SEQ_LENS)
    assert rel_err(out[:n], ref[:n]) < 1e-2
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=2e-2, rtol=2e-2)
    # the written slots: the values the RoPE kernel stores, one rounding step apart at most (the two
    # kernels may contract the rotation's multiply-adds differently): bf16's 2^-8, e4m3's 2^-3 of a binade
    slots = meta.slot_mapping[:n]
    for got, want in ((k_cache, kc_ref), (v_cache, vc_ref)):
        a, b = got.view(-1, hkv, d)[slots].float(), want.view(-1, hkv, d)[slots].float()
        assert (a - b).abs().max().item() <= (0.13 if fp8 else 0.01) * b.abs().max().item()
