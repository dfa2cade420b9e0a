"""atomc::head_matmul's one-token kernels on CUDA in bf16 at DeepSeek-V2-Lite's and V3's widths,
against the bmm, eager and replayed in a CUDA graph with new inputs."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16 = torch.bfloat16


@pytest.mark.parametrize("heads", [16, 128], ids=["v2_lite", "v3"])
def test_one_token_at_deepseek_widths(heads):
    from atomc.kernels.triton.head_matmul import head_matmul
    from atomc.ops.head_matmul import head_matmul_reference

    nope, v, lora, rope = 128, 128, 512, 64
    g = torch.Generator("cuda").manual_seed(0)
    kv_b = (torch.randn(heads * (nope + v), lora, generator=g, device="cuda") / lora**0.5).to(BF16)
    w = kv_b.view(heads, nope + v, lora)
    q = torch.randn(1, heads, nope + rope, generator=g, device="cuda").to(BF16)
    attn = torch.randn(1, heads, lora, generator=g, device="cuda").to(BF16)
    cases = ((q[..., :nope], w[:, :nope], False), (attn, w[:, nope:], True))
    for x, wt, transpose_w in cases:
        want = head_matmul_reference(x, wt, transpose_w).float()
        got = head_matmul(x, wt, transpose_w, one_row=True)
        assert ((got.float() - want).norm() / want.norm()).item() < 1e-2
    # captured and replayed with new inputs in the same buffers
    x, wt, transpose_w = cases[0]
    head_matmul(x, wt, transpose_w, one_row=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = head_matmul(x, wt, transpose_w, one_row=True)
    q.copy_(torch.randn(q.shape, generator=g, device="cuda"))
    graph.replay()
    want = head_matmul_reference(x, wt, transpose_w).float()
    assert ((out.float() - want).norm() / want.norm()).item() < 1e-2
