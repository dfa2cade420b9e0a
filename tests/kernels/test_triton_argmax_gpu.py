"""The Triton argmax on CUDA against torch.argmax, in bf16, fp16 and fp32: planted ties, NaN, -inf,
the real vocabularies, the sampler's route to it, and CUDA-graph replay."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

from argmax_cases import planted_rows  # noqa: E402

DEV = "cuda"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
VOCABS = [1, 7, 1023, 1024, 1025, 102400, 128256, 151936]


def kernel():
    from atomc.kernels.triton import argmax

    return argmax


def check(x: torch.Tensor) -> None:
    got = kernel().argmax_rows(x)
    assert got.dtype == torch.int64 and got.device == x.device
    assert torch.equal(got, x.argmax(dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("rows", [1, 2, 9, 64, 255])
def test_random_rows(rows, vocab, dtype):
    torch.manual_seed(rows + vocab)
    check(torch.randn(rows, vocab, device=DEV).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1025, 3 * 1024 + 5, 102400, 128256, 151936])
def test_planted(vocab, dtype):
    check(planted_rows(18, vocab, kernel().CHUNK, dtype, seed=vocab).to(DEV))


def test_sampler_takes_the_kernel_on_cuda():
    from atomc.runtime.greedy import row_argmax

    assert row_argmax("cuda") is kernel().argmax_rows


def test_cuda_graph_replay():
    x = torch.randn(8, 128256, device=DEV, dtype=torch.bfloat16)
    out = kernel().argmax_rows(x)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel().argmax_rows(x)
    for _ in range(3):
        x.normal_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, x.argmax(dim=-1))
