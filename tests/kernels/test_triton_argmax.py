"""The two-stage Triton argmax against torch.argmax(dim=-1), through the Triton interpreter (fp32 and
fp16: the interpreter mishandles bf16; test_triton_argmax_gpu.py adds bf16 on CUDA). Every result
must equal torch's exactly: the first index of the maximum, the first NaN when a row has one."""

import pytest
import torch
from triton_interpreter import use_interpreter

use_interpreter()  # before the first triton import; the _gpu file covers CUDA

pytest.importorskip("triton")
from argmax_cases import planted_rows  # noqa: E402

from atomc.kernels.triton.argmax import CHUNK, TORCH_FROM_ROWS, argmax_rows  # noqa: E402

DTYPES = [torch.float32, torch.float16]
SMALL_VOCABS = [1, 7, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]
LARGE_VOCABS = [128256, 151936]  # Llama-3, Qwen2


def check(x: torch.Tensor) -> None:
    got = argmax_rows(x)
    assert got.dtype == torch.int64 and got.shape == x.shape[:1]
    assert torch.equal(got, x.argmax(dim=-1)), (got, x.argmax(dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", SMALL_VOCABS)
@pytest.mark.parametrize("rows", range(1, 10))
def test_random_rows(rows, vocab, dtype):
    torch.manual_seed(rows * 1000 + vocab)
    check(torch.randn(rows, vocab).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", LARGE_VOCABS)
@pytest.mark.parametrize("rows", [1, 9])
def test_large_vocab_planted(rows, vocab, dtype):
    x = planted_rows(rows, vocab, CHUNK, dtype, seed=vocab + rows)
    check(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [CHUNK + 1, 3 * CHUNK + 5])
def test_planted_ties_nan_inf(vocab, dtype):
    check(planted_rows(9, vocab, CHUNK, dtype, seed=vocab))


def test_planted_rows_are_the_hard_cases():
    """planted_rows' expected answers, read off torch, so the cases above test what they say."""
    x = planted_rows(9, 3 * CHUNK + 5, CHUNK, torch.float32, seed=0)
    c = CHUNK
    assert x.argmax(dim=-1).tolist() == [c + 5, 10, 2 * c + 1, 0, c + 3, 7, c, 2 * c, 3 * c + 4]


def test_vocab_one_and_all_equal():
    check(torch.zeros(4, 1, dtype=torch.float16))
    check(torch.full((3, 2 * CHUNK + 3), 0.5))  # every index ties: 0
    check(torch.tensor([[0.0, -0.0, 0.0], [-0.0, 0.0, 0.0]]))  # -0.0 ties with 0.0


def test_strided_rows():
    """A view whose rows are wider than its vocab (logits sliced out of a wider buffer)."""
    torch.manual_seed(1)
    wide = torch.randn(5, 3 * CHUNK)
    check(wide[:, : 2 * CHUNK + 7])
    check(wide[::2, 3:])


def test_many_rows_and_empty_go_to_torch():
    check(torch.randn(TORCH_FROM_ROWS, 9))
    check(torch.randn(0, 9))
    with pytest.raises(IndexError):
        argmax_rows(torch.randn(2, 0))  # torch's error for an empty reduction
