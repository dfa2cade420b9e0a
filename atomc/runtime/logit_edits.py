"""Per-request logit edits, before the sampler's penalties and masks: `allowed_token_ids`,
`bad_words` and `logit_bias`, with vLLM's semantics and order (allowed -> bad words -> bias).

Each edit touches only the rows that asked for it: the row and token indices are built on the host
from the requests' own lists (no device value is read back, so no sync) and cross to the device in
one copy per kind; a batch where no row uses them costs one pass over the parameters and nothing on
the device (`apply_logit_edits` returns the logits untouched). A bad word of several tokens bans its
last token only once the tokens before it are the row's latest outputs, so such rows read their
token history (`SamplingParams.reads_history`); single-token bad words are a fixed mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from atomc.runtime.transfer import to_device
from atomc.sampling_params import SamplingParams

_NEG_INF = float("-inf")


def apply_allowed_token_ids(
    logits: torch.Tensor, rows: Sequence[int], allowed: Sequence[Sequence[int]]
) -> torch.Tensor:
    """In place: row `rows[j]` keeps only the logits of `allowed[j]` (ids outside the vocab ignored),
    every other token becomes -inf."""
    vocab = logits.shape[-1]
    allowed = [[t for t in ids if 0 <= t < vocab] for ids in allowed]
    keep = torch.zeros(len(rows), vocab, dtype=torch.bool, device=logits.device)
    flat = [j * vocab + t for j, ids in enumerate(allowed) for t in ids]
    if flat:
        _fill_at(keep, flat, True)
    idx = to_device(list(rows), torch.long, logits.device)
    logits[idx] = logits[idx].masked_fill(~keep, _NEG_INF)
    return logits


def _fill_at(t: torch.Tensor, flat_index: list[int], value: float | bool) -> None:
    """In place: `value` at the given flat positions of contiguous `t`. index_fill_ takes the value
    as a kernel argument; `t[r, c] = value` would copy it to the device from pageable memory, a
    copy that synchronizes the stream."""
    if not t.is_contiguous():
        raise ValueError("logit edits need contiguous logits")
    t.view(-1).index_fill_(0, to_device(flat_index, torch.long, t.device), value)


def banned_by_bad_words(bad_words: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> list[int]:
    """The tokens one row may not sample next: the last token of each bad word whose earlier tokens
    are the row's latest outputs (all of a one-token word). Generated tokens only, as vLLM reads them:
    a word begun in the prompt is not completed."""
    banned = []
    n_out = len(output_token_ids)
    for word in bad_words:
        prefix = len(word) - 1
        if prefix > n_out:
            continue
        if prefix == 0 or list(output_token_ids[n_out - prefix :]) == list(word[:prefix]):
            banned.append(word[-1])
    return banned


def apply_bad_words(
    logits: torch.Tensor,
    rows: Sequence[int],
    bad_words: Sequence[Sequence[Sequence[int]]],
    output_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """In place: -inf for the tokens `banned_by_bad_words` finds for each of `rows` (`output_token_ids`
    is indexed like the logits)."""
    vocab = logits.shape[-1]
    r: list[int] = []
    c: list[int] = []
    for row, words in zip(rows, bad_words, strict=True):
        banned = [t for t in banned_by_bad_words(words, output_token_ids[row]) if 0 <= t < vocab]
        r.extend([row] * len(banned))
        c.extend(banned)
    if r:
        _fill_at(logits, [row * vocab + t for row, t in zip(r, c, strict=True)], _NEG_INF)
    return logits


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[int], biases: Sequence[dict[int, float]]) -> torch.Tensor:
    """In place: add `biases[j][token]` to row `rows[j]`'s logit of each token (ids outside the vocab
    ignored)."""
    vocab = logits.shape[-1]
    r: list[int] = []
    c: list[int] = []
    v: list[float] = []
    for row, bias in zip(rows, biases, strict=True):
        for t, b in bias.items():
            if 0 <= t < vocab:
                r.append(row)
                c.append(t)
                v.append(float(b))
    if r:
        dev = logits.device
        index = (to_device(r, torch.long, dev), to_device(c, torch.long, dev))
        logits.index_put_(index, to_device(v, logits.dtype, dev), accumulate=True)
    return logits


def apply_logit_edits(
    logits: torch.Tensor, params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]]
) -> torch.Tensor:
    """Every row's allowed_token_ids, bad_words and logit_bias, in place on the sampler's float32
    copy of the logits; untouched (no work at all) when no row sets any of them."""
    rows = [i for i, p in enumerate(params) if p.edits_logits]
    if not rows:
        return logits
    allowed = [i for i in rows if params[i].allowed_token_ids is not None]
    if allowed:
        apply_allowed_token_ids(logits, allowed, [params[i].allowed_token_ids for i in allowed])
    banning = [i for i in rows if params[i].bad_words_token_ids]
    if banning:
        apply_bad_words(logits, banning, [params[i].bad_words_token_ids for i in banning], output_token_ids)
    biased = [i for i in rows if params[i].logit_bias]
    if biased:
        apply_logit_bias(logits, biased, [params[i].logit_bias for i in biased])
    return logits
