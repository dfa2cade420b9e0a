"""Token sampling for one engine step, with vLLM's semantics.

Order per row: logit edits (allowed_token_ids, bad_words, logit_bias; logit_edits.py) -> penalties ->
min_tokens mask -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> draw. Logprobs come from
the raw logits (vLLM's default "raw_logprobs"), as do the prompt's (`prompt_logprob_entries`). Mask work
is batched; only the random draws loop per row, each on CPU with the row's own generator, so a seeded
row reproduces exactly whatever else is in the batch and whatever device the logits live on.

The sampler never returns an id outside [0, vocab): a drawn row with no finite probability mass left
(inf or NaN logits, every token masked) takes the argmax of its logits before the masks, NaN read as
-inf, and is counted in `SamplerOutput.num_fallbacks` (the server exports it as a metric). The count
rides back with the tokens, so the check costs no extra device sync.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from atomc.runtime.batch import PromptLogprobRequest
from atomc.runtime.greedy import greedy_tokens
from atomc.runtime.logit_edits import apply_logit_edits
from atomc.runtime.transfer import to_device, to_host_async
from atomc.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplingBatch:
    """One row per sequence that needs a token this step; built by the model runner."""

    params: list[SamplingParams]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    # per-row generator when the request has a seed, else None (the sampler's engine-wide one is used)
    generators: list[torch.Generator | None]


def _plain_greedy(p: SamplingParams, num_outputs: int) -> bool:
    """Greedy with nothing that edits the logits first (penalties, min_tokens, logit edits) and no
    logprobs (nor a best_of ranking, which reads the sampled token's)."""
    return (
        p.greedy
        and p.logprobs is None
        and not p.has_penalties
        and num_outputs >= p.min_tokens
        and not p.edits_logits
        and not p.ranks_samples
    )


def _wants_logprob(p: SamplingParams) -> bool:
    """The sampled token's logprob comes back: asked for, or to rank best_of samples."""
    return p.logprobs is not None or p.ranks_samples


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row: {sampled token: lp, top-N tokens: lp} when params.logprobs is not None, else None
    logprobs: list[dict[int, float] | None]
    num_fallbacks: int = 0  # rows with nothing left to draw from, given their fallback token


class PendingSample:
    """One step's sampled tokens (and logprobs) on their way to the host.

    The copies are queued behind the step's kernels; `result()` waits for them. `token_ids` stays
    on the device, where the next step can take its inputs from it before anything is read back.
    """

    def __init__(
        self,
        token_ids: torch.Tensor,
        logprob_rows: list[int],
        logprob_n: list[int],
        lp: list[torch.Tensor],
        fallbacks: torch.Tensor | None = None,
    ):
        self.token_ids = token_ids
        self._rows, self._n = logprob_rows, logprob_n
        self._host = [to_host_async(t) for t in (token_ids, *lp)]
        self._fallbacks = None if fallbacks is None else to_host_async(fallbacks)
        self._ready = None
        if token_ids.device.type == "cuda":
            self._ready = torch.cuda.Event()
            self._ready.record()
        self._result: SamplerOutput | None = None

    def result(self) -> SamplerOutput:
        if self._result is None:
            if self._ready is not None:
                self._ready.synchronize()
            token_list = self._host[0].tolist()
            fallbacks = 0 if self._fallbacks is None else int(self._fallbacks)
            self._result = SamplerOutput(token_list, self._logprobs(token_list), fallbacks)
        return self._result

    def _logprobs(self, token_list: list[int]) -> list[dict[int, float] | None]:
        out: list[dict[int, float] | None] = [None] * len(token_list)
        if not self._rows:
            return out
        sampled = self._host[1].tolist()
        top_vals, top_ids = (self._host[2].tolist(), self._host[3].tolist()) if len(self._host) > 2 else ([], [])
        for j, i in enumerate(self._rows):
            d = {token_list[i]: sampled[j]}  # sampled token first, as vLLM lists it
            n = self._n[j]
            if n > 0:
                for t, v in zip(top_ids[j][:n], top_vals[j][:n], strict=True):
                    d.setdefault(t, v)
            out[i] = d
        return out


def _row_param(values: Sequence[float] | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-row parameter as a [B, 1] column on logits' device and dtype, ready to broadcast."""
    return to_device(values, like.dtype, like.device).reshape(-1, 1)


def _token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int, like: torch.Tensor) -> torch.Tensor:
    """[B, V] occurrence counts of each token per row."""
    counts = torch.zeros(len(token_ids), vocab_size, dtype=like.dtype, device=like.device)
    lengths = torch.tensor([len(ids) for ids in token_ids])
    if int(lengths.sum()) == 0:
        return counts
    # chain + repeat_interleave keeps the flattening in C; prompts can be thousands of tokens per row
    cols = torch.tensor(list(itertools.chain.from_iterable(token_ids)), dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(token_ids)), lengths)
    ones = torch.ones(cols.numel(), dtype=like.dtype, device=like.device)
    dev = like.device
    counts.index_put_((to_device(rows, torch.long, dev), to_device(cols, torch.long, dev)), ones, accumulate=True)
    return counts


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition_penalty: Sequence[float] | torch.Tensor,
    frequency_penalty: Sequence[float] | torch.Tensor,
    presence_penalty: Sequence[float] | torch.Tensor,
) -> torch.Tensor:
    """vLLM penalties; returns a new tensor.

    Repetition: over prompt + output tokens, positive logits divided by p, the rest multiplied by p.
    Frequency / presence: over output tokens only, subtract freq * count and presence * (count > 0).
    """
    vocab = logits.shape[-1]
    out_counts = _token_counts(output_token_ids, vocab, logits)
    rep = _row_param(repetition_penalty, logits)
    if any(r != 1 for r in repetition_penalty):  # host values: no sync
        seen = (_token_counts(prompt_token_ids, vocab, logits) + out_counts) > 0
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    logits = logits - _row_param(frequency_penalty, logits) * out_counts
    return logits - _row_param(presence_penalty, logits) * (out_counts > 0).to(logits.dtype)


def apply_min_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]]
) -> torch.Tensor:
    """Forbid stop tokens (eos + stop_token_ids) while a row has fewer than min_tokens outputs.

    Like vLLM, eos is left alone under ignore_eos: it does not stop the row, so there is nothing to delay.
    """
    vocab = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    for r, (p, out) in enumerate(zip(params, output_token_ids, strict=True)):
        if len(out) >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids or [])
        if not p.ignore_eos:
            stops.update(p.eos_token_ids)
        ids = [t for t in stops if 0 <= t < vocab]
        rows.extend([r] * len(ids))
        cols.extend(ids)
    if not rows:
        return logits
    logits = logits.clone()
    logits[to_device(rows, torch.long, logits.device), to_device(cols, torch.long, logits.device)] = _NEG_INF
    return logits


def apply_top_k(logits: torch.Tensor, top_k: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits (ties with the k-th kept, as in vLLM); k <= 0 or k >= V = off."""
    vocab = logits.shape[-1]
    ks = [vocab if k <= 0 or k > vocab else int(k) for k in top_k]  # host values: no sync
    if all(k == vocab for k in ks):
        return logits
    kmax = max(ks)
    k = to_device(ks, torch.long, logits.device).reshape(-1, 1)
    # topk to the largest k in the batch is cheaper than a full sort when k is small
    top_vals = logits.topk(kmax, dim=-1).values
    threshold = top_vals.gather(-1, k - 1)
    return logits.masked_fill(logits < threshold, _NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Keep the smallest most-probable set whose probability reaches top_p (at least one token); 1 = off."""
    p = torch.as_tensor(top_p, dtype=logits.dtype, device=logits.device).reshape(-1, 1)
    # rows with p >= 1 must keep everything even if float cumsum reaches 1 early
    p = torch.where(p >= 1, torch.full_like(p, 2.0), p)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= p  # the top token has mass_before 0 < p, so it always stays
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability; 0 = off."""
    probs = logits.softmax(dim=-1)
    threshold = _row_param(min_p, logits) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, _NEG_INF)


def _draw_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draw: one uniform per row picks the token where the row's CDF first exceeds it.

    Only B uniforms cross to the device (not B x V noise); float64 keeps the CDF accurate over large vocabs.
    Returns the drawn ids, each in [0, V), and a [B] mask of the rows that had mass to draw from: a
    row whose total is NaN, inf or 0 has no CDF, and its id means nothing (the caller replaces it).
    """
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    total = cdf[:, -1:]
    target = to_device(uniforms, torch.float64, probs.device).reshape(-1, 1) * total
    # u * total can round up to total; stay strictly below so a positive-probability token is hit
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    drawn = torch.searchsorted(cdf, target, right=True).reshape(-1)
    ok = (torch.isfinite(total) & (total > 0)).reshape(-1)
    return drawn.clamp_(max=probs.shape[-1] - 1), ok


_BIT_SHIFTS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> None:
    """Structured outputs: set to -inf, in place, every logit the grammar forbids.

    `bitmask`: int32 [logits rows, W] on the host (pinned on CUDA, so the copy does not wait) or the
    device; bit j of word w of row i allows token 32 * w + j of logits row i (xgrammar's layout).
    `rows`: the logits rows to mask, None for all of them; the other rows of `bitmask` are not read.
    Tokens past the mask's width are forbidden. On a GPU this is one kernel (xgrammar's Triton
    kernel); on the CPU a few torch ops. Runs outside any CUDA graph (the graphs end at the logits);
    a batch without constrained rows never calls it.
    """
    n_rows, vocab = logits.shape
    if bitmask.shape[0] != n_rows:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows, logits {n_rows}")
    rows = list(range(n_rows)) if rows is None else list(rows)
    if not rows:
        return
    width = bitmask.shape[1] * 32
    device = logits.device
    words = bitmask if bitmask.device == device else to_device(bitmask, torch.int32, device)
    if device.type == "cuda":
        from xgrammar import apply_token_bitmask_inplace  # imported with the grammar that made the mask

        index = _row_index(tuple(rows), device)
        apply_token_bitmask_inplace(logits, words, vocab_size=min(vocab, width), indices=index, backend="triton")
        if width < vocab:  # index_fill_ takes -inf as a kernel argument (no pageable copy, no sync)
            logits[:, width:].index_fill_(0, index.long(), _NEG_INF)
        return
    mask_with_torch(logits, words, rows)


@functools.lru_cache(maxsize=4)
def _row_index(rows: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The masked rows as a device int32 tensor, kept: a step's constrained rows are usually the
    last step's, so most steps copy nothing."""
    return to_device(list(rows), torch.int32, device)


def mask_with_torch(logits: torch.Tensor, words: torch.Tensor, rows: list[int]) -> None:
    """apply_token_bitmask's CPU path (`words` on the logits' device): unpack the bits, masked_fill."""
    n_rows, vocab = logits.shape
    device = logits.device
    shifts = _BIT_SHIFTS.get(device)
    if shifts is None:
        shifts = _BIT_SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    all_rows = len(rows) == n_rows and rows == list(range(n_rows))
    idx = None if all_rows else to_device(rows, torch.long, device)
    if idx is not None:
        words = words[idx]
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().reshape(len(rows), -1)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    forbidden = ~allowed[:, :vocab]
    if idx is None:
        logits.masked_fill_(forbidden, _NEG_INF)
    else:
        logits[idx] = logits[idx].masked_fill(forbidden, _NEG_INF)


def fallback_tokens(logits: torch.Tensor) -> torch.Tensor:
    """A defined token for a row that has nothing left to draw from: the argmax, NaN read as -inf."""
    return logits.masked_fill(logits.isnan(), _NEG_INF).argmax(dim=-1)


class Sampler:
    def __init__(self, seed: int = 0):
        # engine-wide stream for unseeded rows; CPU so the draws do not depend on the device
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(seed)

    def _uniforms(self, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        """One float64 uniform per row: seeded rows from their own generator, the rest from the engine one."""
        u = torch.empty(len(generators), dtype=torch.float64)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), generator=self.generator, dtype=torch.float64)
        for i, g in enumerate(generators):
            if g is not None:
                u[i] = torch.rand(1, generator=g, dtype=torch.float64, device=g.device).item()
        return u

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        return self.sample(logits, batch).result()

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> PendingSample:
        """Queue the sampling kernels and the copies back; nothing here waits for the device."""
        params = batch.params
        n_rows, vocab = logits.shape
        lens = {len(params), len(batch.prompt_token_ids), len(batch.output_token_ids), len(batch.generators)}
        if lens != {n_rows}:
            raise ValueError(f"sampling batch has {len(params)} rows but logits have {n_rows}")
        if all(_plain_greedy(p, len(out)) for p, out in zip(params, batch.output_token_ids, strict=True)):
            # the common serving case: the argmax kernels (greedy.py) and one copy back, nothing per row
            return PendingSample(greedy_tokens(logits), [], [], [])
        device = logits.device
        x = logits.to(torch.float32, copy=True)  # never modify the caller's logits (logprobs need them raw)
        x = apply_logit_edits(x, params, batch.output_token_ids)

        pen = [i for i, p in enumerate(params) if p.has_penalties]
        if pen:
            idx = to_device(pen, torch.long, device)
            x[idx] = apply_penalties(
                x[idx],
                [batch.prompt_token_ids[i] for i in pen],
                [batch.output_token_ids[i] for i in pen],
                [params[i].repetition_penalty for i in pen],
                [params[i].frequency_penalty for i in pen],
                [params[i].presence_penalty for i in pen],
            )
        x = apply_min_tokens(x, params, batch.output_token_ids)

        tokens = torch.empty(n_rows, dtype=torch.long, device=device)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        rand = [i for i, p in enumerate(params) if not p.greedy]
        if greedy:
            idx = to_device(greedy, torch.long, device)
            tokens[idx] = greedy_tokens(x[idx])
        if rand:
            idx = to_device(rand, torch.long, device)
            rp = [params[i] for i in rand]
            xr = x[idx] / _row_param([p.temperature for p in rp], x)
            if any(p.top_k > 0 for p in rp):
                xr = apply_top_k(xr, [p.top_k for p in rp])
            if any(p.top_p < 1.0 for p in rp):
                xr = apply_top_p(xr, [p.top_p for p in rp])
            if any(p.min_p > 0.0 for p in rp):
                xr = apply_min_p(xr, [p.min_p for p in rp])
            uniforms = self._uniforms([batch.generators[i] for i in rand])
            drawn, ok = _draw_from_probs(xr.softmax(dim=-1), uniforms)
            tokens[idx] = torch.where(ok, drawn, fallback_tokens(x[idx]))
            fallbacks = (~ok).sum()
        else:
            fallbacks = None
        return self._with_logprobs(logits, params, tokens, fallbacks)

    @staticmethod
    def _with_logprobs(
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        tokens: torch.Tensor,
        fallbacks: torch.Tensor | None = None,
    ) -> PendingSample:
        """Logprobs from the raw logits for the rows that asked: the sampled token's, and the top N."""
        rows = [i for i, p in enumerate(params) if _wants_logprob(p)]
        if not rows:
            return PendingSample(tokens, [], [], [], fallbacks)
        idx = to_device(rows, torch.long, logits.device)
        lp = torch.log_softmax(logits[idx].float(), dim=-1)
        sampled = lp.gather(-1, tokens[idx].reshape(-1, 1)).reshape(-1)
        n = [params[i].logprobs or 0 for i in rows]
        if max(n) <= 0:
            return PendingSample(tokens, rows, n, [sampled], fallbacks)
        top = lp.topk(min(max(n), lp.shape[-1]), dim=-1)
        return PendingSample(tokens, rows, n, [sampled, top.values, top.indices], fallbacks)


def prompt_logprob_entries(req: PromptLogprobRequest, logits: torch.Tensor) -> list[dict[int, float]]:
    """Per row of `req` (its `logits`, one row a target): the target's logprob and the top N."""
    logprobs = torch.log_softmax(logits, -1)
    targets = torch.tensor(req.target_ids, device=logprobs.device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    top = logprobs.topk(req.top_n, dim=-1) if req.top_n > 0 else None
    entries = []
    for j, tok in enumerate(req.target_ids):
        entry = {tok: chosen[j]}
        if top is not None:
            entry.update(zip(top.indices[j].tolist(), top.values[j].tolist(), strict=True))
        entries.append(entry)
    return entries
