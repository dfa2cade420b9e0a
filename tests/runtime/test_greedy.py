"""greedy_tokens: which argmax serves a device, and that both greedy paths of the sampler take it."""

from __future__ import annotations

import torch

from atomc.runtime import greedy
from atomc.runtime.sampler import Sampler, SamplingBatch
from atomc.sampling_params import SamplingParams as SP


def test_cpu_keeps_torch():
    assert greedy.row_argmax("cpu") is greedy._torch_argmax
    x = torch.tensor([[1.0, 3.0, 3.0], [float("nan"), 2.0, float("nan")]])
    assert greedy.greedy_tokens(x).tolist() == [1, 0]


def _batch(params) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(list(params), [[]] * n, [[1]] * n, [None] * n)


def test_sampler_greedy_paths_take_greedy_tokens(monkeypatch):
    """The plain-greedy fast path and the greedy rows of a mixed batch both go through row_argmax
    (on CUDA: the Triton kernel); the spy answers differently from torch to show its answer is used."""
    calls = []

    def spy(logits):
        calls.append(logits.shape)
        return torch.full((logits.shape[0],), 2, dtype=torch.long, device=logits.device)

    monkeypatch.setattr(greedy, "row_argmax", lambda device_type: spy)
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]] * 3)
    assert Sampler()(logits, _batch([SP(temperature=0)] * 3)).token_ids == [2, 2, 2]
    assert calls == [(3, 4)]

    mixed = [SP(temperature=0, presence_penalty=0.5), SP(temperature=1.0, seed=1), SP(temperature=0)]
    out = Sampler()(logits, _batch(mixed))
    assert out.token_ids[0] == 2 and out.token_ids[2] == 2
    assert calls[1:] == [(2, 4)]  # the two greedy rows, in one call


def test_warm_greedy_compiles_both_inputs(monkeypatch):
    """One row of the raw logits and one of its fp32 copy: the two dtypes the sampler hands over."""
    seen = []
    monkeypatch.setattr(greedy, "row_argmax", lambda device_type: lambda x: seen.append((x.shape, x.dtype)))
    greedy.warm_greedy(torch.zeros(5, 11, dtype=torch.bfloat16))
    assert seen == [((1, 11), torch.bfloat16), ((1, 11), torch.float32)]
