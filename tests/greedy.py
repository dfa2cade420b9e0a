"""Comparing greedy token sequences from two different computations (batched vs alone, compiled vs
eager, atomc vs transformers).

Their logits agree to float32 rounding, not bit for bit: a different GEMM shape or kernel sums in a
different order, and how depends on the CPU (AVX2 vs AVX-512). So two greedy runs may part at a step
where the reference's two best logits are within that rounding of each other, a near-tie, and then
legitimately continue differently. `assert_greedy_agree` accepts exactly that: the sequences match up
to the first difference, and at that step the reference's top-2 gap is below `margin`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# logits of these tiny fp32 models differ by ~1e-5 between kernels; a real divergence is far larger
MARGIN = 1e-3


def assert_greedy_agree(
    got: Sequence[int],
    want: Sequence[int],
    prompt: Sequence[int],
    logits_of: Callable[[list[int]], torch.Tensor],
    margin: float = MARGIN,
) -> None:
    """`logits_of(ids)` -> [len(ids), vocab] reference logits for the token sequence `ids`."""
    got, want = list(got), list(want)
    diff = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if diff is None:
        assert len(got) == len(want), (got, want)
        return
    logits = logits_of(list(prompt) + want[: diff + 1])[len(prompt) + diff - 1].float()
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    pair = float(logits[want[diff]] - logits[got[diff]])
    assert gap < margin and abs(pair) < margin, (
        f"greedy tokens differ at step {diff} ({got[diff]} vs {want[diff]}) where the reference's "
        f"top-2 logit gap is {gap:.3g}, not a near-tie: got {got}, want {want}"
    )


def model_logits(model) -> Callable[[list[int]], torch.Tensor]:
    """`logits_of` for an atomc model (models.loader.load_model)."""

    def logits_of(ids: list[int]) -> torch.Tensor:
        t = torch.tensor(ids)
        with torch.inference_mode():
            return model.compute_logits(model(t, torch.arange(t.numel())))

    return logits_of


def assert_outputs_close(outs, want, llm, prompts: Sequence[str], margin: float, logprob_tol: float) -> None:
    """Each of `outs` (RequestOutputs with logprobs) against the reference run `want` of the same
    prompts on engine `llm`: greedy tokens agree up to a near-tie within `margin` of the reference
    model's logits, and the chosen tokens' logprobs on the shared steps within `logprob_tol`."""
    tok = llm.get_tokenizer()
    logits_of = model_logits(llm.engine.runner.model)
    for prompt, got, ref in zip(prompts, outs, want, strict=True):
        g, r = got.outputs[0], ref.outputs[0]
        assert_greedy_agree(g.token_ids, r.token_ids, tok.encode(prompt), logits_of, margin=margin)
        pairs = zip(g.token_ids, r.token_ids, strict=False)
        shared = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(g.token_ids), len(r.token_ids)))
        for step in range(shared):
            tok_id = r.token_ids[step]
            move = abs(g.logprobs[step][tok_id] - r.logprobs[step][tok_id])
            assert move < logprob_tol, (prompt, step, move)


def assert_agree_by_own_logprobs(got, want, margin: float, logprob_tol: float) -> None:
    """`got` against the reference run `want` (CompletionOutputs with top logprobs) of two engines of
    one precision that differ in one approximation (an FP8 cache): on the shared steps the
    reference token's logprob moves by under `logprob_tol`, and where the tokens part, `got`'s token
    is among the reference run's top logprobs within `margin` of its best: a near-tie of the
    reference engine's own distribution (a bf16 engine's choices are not the fp32 model's)."""
    g, w = list(got.token_ids), list(want.token_ids)
    diff = next((i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), None)
    for step in range(min(len(g), len(w)) if diff is None else diff):
        move = abs(got.logprobs[step][w[step]] - want.logprobs[step][w[step]])
        assert move < logprob_tol, f"step {step}: the reference token's logprob moved by {move:.3g}"
    if diff is None:
        assert len(g) == len(w), (g, w)
        return
    top = want.logprobs[diff]
    assert g[diff] in top, f"step {diff}: token {g[diff]} is not among the reference run's top {len(top)}: {top}"
    gap = top[w[diff]] - top[g[diff]]
    assert gap < margin, f"step {diff}: {g[diff]} vs {w[diff]} at a logprob gap of {gap:.3g}, not a near-tie"
