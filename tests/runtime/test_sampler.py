"""Sampler: masks and penalties against direct per-element computations, seeding, logprobs, min_tokens."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from atomc.runtime.sampler import (
    Sampler,
    SamplingBatch,
    _draw_from_probs,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
)
from atomc.sampling_params import SamplingParams as SP


def make_batch(params, prompts=None, outputs=None, seeds=None) -> SamplingBatch:
    n = len(params)
    seeds = seeds if seeds is not None else [p.seed for p in params]
    gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    return SamplingBatch(
        params=list(params),
        prompt_token_ids=prompts if prompts is not None else [[] for _ in range(n)],
        output_token_ids=outputs if outputs is not None else [[] for _ in range(n)],
        generators=gens,
    )


def softmax_np(row: np.ndarray) -> np.ndarray:
    e = np.exp(row - row.max())
    return e / e.sum()


# --- direct references: sort, then walk the row in python --------------------------------------------


def ref_top_k(row: np.ndarray, k: int) -> set[int]:
    if k <= 0 or k >= len(row):
        return set(range(len(row)))
    kth = sorted(row.tolist(), reverse=True)[k - 1]
    return {i for i, v in enumerate(row) if v >= kth}


def ref_top_p(row: np.ndarray, p: float) -> set[int]:
    if p >= 1:
        return set(range(len(row)))
    probs = softmax_np(row)
    keep, mass = set(), 0.0
    for i in sorted(range(len(row)), key=lambda i: -probs[i]):
        keep.add(i)
        mass += probs[i]
        if mass >= p:
            break
    return keep


def ref_min_p(row: np.ndarray, mp: float) -> set[int]:
    probs = softmax_np(row)
    return {i for i in range(len(row)) if probs[i] >= mp * probs.max()}


def kept(t: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(torch.isfinite(r)).reshape(-1).tolist()) for r in t]


def check_mask(out: torch.Tensor, logits: torch.Tensor, expect: list[set[int]]) -> None:
    assert kept(out) == expect
    fin = torch.isfinite(out)
    torch.testing.assert_close(out[fin], logits[fin], rtol=0, atol=0)  # kept logits are untouched


# --- pure mask helpers -----------------------------------------------------------------------------


@pytest.mark.parametrize("trial", range(5))
def test_top_k_matches_direct(trial):
    g = torch.Generator().manual_seed(trial)
    logits = torch.randn(8, 40, generator=g, dtype=torch.float64) * 3
    ks = [0, 1, 2, 5, 17, 39, 40, 100]
    out = apply_top_k(logits, ks)
    check_mask(out, logits, [ref_top_k(r, k) for r, k in zip(logits.numpy(), ks, strict=True)])


@pytest.mark.parametrize("trial", range(5))
def test_top_p_matches_direct(trial):
    g = torch.Generator().manual_seed(100 + trial)
    logits = torch.randn(10, 40, generator=g, dtype=torch.float64) * 2
    ps = [1.0, 1e-6, 0.1, 0.3, 0.5, 0.7, 0.9, 0.95, 0.999] + [torch.rand(1, generator=g).item()]
    out = apply_top_p(logits, ps)
    check_mask(out, logits, [ref_top_p(r, p) for r, p in zip(logits.numpy(), ps, strict=True)])


@pytest.mark.parametrize("trial", range(5))
def test_min_p_matches_direct(trial):
    g = torch.Generator().manual_seed(200 + trial)
    logits = torch.randn(8, 40, generator=g, dtype=torch.float64) * 2
    mps = [0.0, 1e-3, 0.01, 0.05, 0.1, 0.3, 0.9, 1.0]
    out = apply_min_p(logits, mps)
    check_mask(out, logits, [ref_min_p(r, m) for r, m in zip(logits.numpy(), mps, strict=True)])


def test_penalties_match_direct_loop():
    g = torch.Generator().manual_seed(7)
    B, V = 5, 30
    logits = torch.randn(B, V, generator=g, dtype=torch.float64) * 3
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (0, 3, 10, 25, 4)]
    outputs = [torch.randint(0, V, (n,), generator=g).tolist() for n in (6, 0, 12, 3, 20)]
    rep = [1.3, 0.7, 1.0, 2.0, 1.1]
    freq = [0.5, 0.0, -0.4, 1.5, 0.2]
    pres = [0.3, 1.0, 0.0, -0.8, 2.0]
    out = apply_penalties(logits, prompts, outputs, rep, freq, pres)

    expect = logits.clone().numpy()
    for b in range(B):
        for t in range(V):
            x = expect[b, t]
            if t in prompts[b] or t in outputs[b]:
                x = x / rep[b] if x > 0 else x * rep[b]
            count = outputs[b].count(t)
            x -= freq[b] * count
            x -= pres[b] * (1 if count > 0 else 0)
            expect[b, t] = x
    np.testing.assert_allclose(out.numpy(), expect, rtol=1e-12, atol=1e-12)
    assert not torch.equal(out, logits)  # pure: input untouched, output changed


def test_penalties_in_sampler_greedy():
    # greedy picks argmax of the penalised logits, checked against apply_penalties directly
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 20, generator=g)
    top = logits.argmax(-1).tolist()
    params = [SP(temperature=0, repetition_penalty=5.0, frequency_penalty=1.0, presence_penalty=1.0)] * 4
    outputs = [[t, t] for t in top]
    res = Sampler()(logits, make_batch(params, outputs=outputs))
    ref = apply_penalties(logits, [[]] * 4, outputs, [5.0] * 4, [1.0] * 4, [1.0] * 4).argmax(-1).tolist()
    assert res.token_ids == ref
    assert all(a != b for a, b in zip(res.token_ids, top, strict=True))  # penalty moved every row


# --- sampler ---------------------------------------------------------------------------------------


def test_greedy_is_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 100, generator=g)
    res = Sampler()(logits, make_batch([SP(temperature=0.0)] * 6))
    assert res.token_ids == logits.argmax(-1).tolist()
    assert res.logprobs == [None] * 6


def test_input_logits_untouched_and_low_precision_ok():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=g).to(torch.bfloat16)
    before = logits.clone()
    params = [SP(temperature=0.0, repetition_penalty=2.0), SP(top_k=5, seed=1), SP(min_tokens=3)]
    params[2].eos_token_ids = [0]
    res = Sampler()(logits, make_batch(params, prompts=[[1, 2, 3]] * 3, outputs=[[4]] * 3))
    assert torch.equal(logits, before)
    assert all(0 <= t < 50 for t in res.token_ids)


def steps(sampler: Sampler, logits_seq, params, seeds):
    """Run several steps, appending outputs like the runner would; generators persist across steps."""
    batch = make_batch(params, seeds=seeds)
    toks = []
    for logits in logits_seq:
        out = sampler(logits, batch).token_ids
        for row, t in zip(batch.output_token_ids, out, strict=True):
            row.append(t)
        toks.append(out)
    return toks


def test_seeded_rows_reproduce():
    g = torch.Generator().manual_seed(11)
    seq = [torch.randn(3, 200, generator=g) for _ in range(10)]
    params = [SP(seed=5), SP(seed=6, top_p=0.9), SP(seed=7, top_k=20, temperature=1.5)]
    a = steps(Sampler(seed=0), seq, params, [5, 6, 7])
    b = steps(Sampler(seed=123), seq, params, [5, 6, 7])  # engine seed must not matter for seeded rows
    assert a == b


def test_seeded_row_independent_of_batch():
    g = torch.Generator().manual_seed(12)
    V = 300
    target = [torch.randn(V, generator=g) for _ in range(8)]
    p = SP(seed=42, top_p=0.95, temperature=0.8)
    alone = [r[0] for r in steps(Sampler(), [t[None] for t in target], [p], [42])]

    # same row at position 2 among unseeded, greedy and differently seeded rows
    others = [SP(), SP(temperature=0), SP(seed=9, top_k=3)]
    params = [others[0], others[1], p, others[2]]
    seq = []
    for t in target:
        noise = torch.randn(4, V, generator=g)
        noise[2] = t
        seq.append(noise)
    mixed = [r[2] for r in steps(Sampler(seed=99), seq, params, [None, None, 42, 9])]
    assert alone == mixed


def test_different_seeds_differ():
    V, n = 1000, 200
    logits = torch.zeros(n, V)  # uniform: two independent streams agree on ~1/V of draws
    a = Sampler()(logits, make_batch([SP(seed=1)] * n, seeds=[1] * n)).token_ids
    b = Sampler()(logits, make_batch([SP(seed=2)] * n, seeds=[2] * n)).token_ids
    assert sum(x == y for x, y in zip(a, b, strict=True)) < 10
    # unseeded rows: distinct engine seeds give distinct streams, and rows within a step differ too
    c = Sampler(seed=1)(logits, make_batch([SP()] * n)).token_ids
    d = Sampler(seed=2)(logits, make_batch([SP()] * n)).token_ids
    assert sum(x == y for x, y in zip(c, d, strict=True)) < 10
    assert len(set(c)) > n // 2


def test_sampling_follows_softmax():
    # the empirical distribution of many draws matches softmax(logits / T)
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    n = 20000
    res = Sampler(seed=3)(logits.expand(n, -1), make_batch([SP(temperature=0.7)] * n))
    freq = np.bincount(res.token_ids, minlength=5) / n
    expect = torch.softmax(logits / 0.7, -1).numpy()
    assert np.abs(freq - expect).max() < 0.015


@pytest.mark.parametrize(
    "kw",
    [dict(top_k=3), dict(top_p=0.6), dict(min_p=0.2), dict(top_k=8, top_p=0.8, min_p=0.1, temperature=1.7)],
)
def test_draws_stay_in_allowed_set(kw):
    g = torch.Generator().manual_seed(21)
    V, n = 64, 3000
    row = (torch.randn(V, generator=g) * 2).double()  # float32-representable, as the sampler sees it
    p = SP(**kw)
    # allowed set from the direct references, applied in the sampler's order on temperature-scaled logits
    x = row / p.temperature
    allowed = ref_top_k(x.numpy(), p.top_k)
    x = x.clone()
    x[[i for i in range(V) if i not in allowed]] = -math.inf
    allowed = ref_top_p(x.numpy(), p.top_p) & allowed
    x[[i for i in range(V) if i not in allowed]] = -math.inf
    allowed = ref_min_p(x.numpy(), p.min_p) & allowed
    assert 1 <= len(allowed) < V

    toks = Sampler(seed=4)(row.float().expand(n, -1), make_batch([p] * n)).token_ids
    assert set(toks) <= allowed
    assert len(set(toks)) > 1 or len(allowed) == 1  # it does sample, not collapse to argmax


def test_logprobs_sampled_and_top_n_from_raw_logits():
    g = torch.Generator().manual_seed(31)
    logits = torch.randn(4, 50, generator=g)
    params = [
        SP(logprobs=3, temperature=2.0, repetition_penalty=1.5),
        SP(logprobs=0),
        SP(),
        SP(logprobs=5, temperature=0),
    ]
    res = Sampler(seed=5)(logits, make_batch(params, prompts=[[1, 2]] * 4, outputs=[[3]] * 4))
    raw = torch.log_softmax(logits.double(), -1)
    assert res.logprobs[2] is None
    for row, n in ((0, 3), (1, 0), (3, 5)):
        d = res.logprobs[row]
        tok = res.token_ids[row]
        top = raw[row].topk(n).indices.tolist() if n else []
        assert next(iter(d)) == tok  # sampled token listed first
        assert set(d) == {tok, *top}
        for t, v in d.items():
            assert v == pytest.approx(raw[row, t].item(), abs=1e-5)
    assert res.logprobs[3][res.token_ids[3]] == pytest.approx(raw[3].max().item(), abs=1e-5)


def test_min_tokens_masks_eos_and_stop_tokens():
    V = 10
    logits = torch.zeros(1, V)
    logits[0, 7] = 10.0  # eos is the argmax
    logits[0, 5] = 9.0  # a stop token id, second
    p = SP(temperature=0, min_tokens=2, max_tokens=5, stop_token_ids=[5])
    p.eos_token_ids = [7]
    s = Sampler()
    assert s(logits, make_batch([p], outputs=[[1]])).token_ids == [logits[0, :5].argmax().item()]
    assert s(logits, make_batch([p], outputs=[[1, 2]])).token_ids == [7]  # min_tokens reached
    # random rows too: eos and stop ids never drawn while below min_tokens
    q = SP(min_tokens=3, max_tokens=5, stop_token_ids=[5])
    q.eos_token_ids = [7]
    toks = s(logits.expand(500, -1), make_batch([q] * 500, outputs=[[1]] * 500)).token_ids
    assert not {5, 7} & set(toks)
    # ignore_eos: eos does not end the row, so (like vLLM) it is not masked; the stop id still is
    r = SP(temperature=0, min_tokens=2, max_tokens=5, stop_token_ids=[5], ignore_eos=True)
    r.eos_token_ids = [7]
    assert s(logits, make_batch([r], outputs=[[]])).token_ids == [7]


def test_draw_edges_never_pick_zero_probability_tokens():
    # u = 0, a CDF step and u just below 1 (u * total may round up to total) must all land on kept tokens
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(3, -1)
    u = torch.tensor([0.0, 0.5, 1 - 2**-53], dtype=torch.float64)
    drawn, ok = _draw_from_probs(probs, u)
    assert drawn.tolist() == [1, 3, 3] and ok.all()


def test_empty_batch():
    res = Sampler()(torch.zeros(0, 10), make_batch([]))
    assert res.token_ids == [] and res.logprobs == []


def test_all_greedy_fast_path_matches_general_path(monkeypatch):
    """A batch of plain greedy rows takes one argmax; the tokens equal the general path's, and a
    row with pending min_tokens still sends the batch through the masks (eos forbidden)."""
    import atomc.runtime.sampler as sampler_module

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    logits[0, 7] = 100.0  # row 0 would pick token 7
    params = [SP(temperature=0) for _ in range(6)]
    fast = Sampler()(logits, make_batch(params))
    calls = []
    monkeypatch.setattr(sampler_module, "_plain_greedy", lambda p, n: calls.append(1) and False)
    general = Sampler()(logits, make_batch(params))
    assert calls and fast.token_ids == general.token_ids
    assert fast.token_ids == logits.argmax(-1).tolist() and fast.logprobs == [None] * 6
    monkeypatch.undo()
    held = [SP(temperature=0, min_tokens=2)] + params[1:]
    held[0].eos_token_ids = [7]
    out = Sampler()(logits, make_batch(held, outputs=[[1]] + [[] for _ in range(5)]))
    assert out.token_ids[0] != 7 and out.token_ids[1:] == fast.token_ids[1:]
