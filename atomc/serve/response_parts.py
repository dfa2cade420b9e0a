"""The pieces of response bodies built per token: usage, and logprobs in their three shapes.

Plain dicts, not pydantic models: they are built per streamed token and only ever serialized.
Completions' legacy parallel lists, vLLM's `prompt_logprobs` and chat's `logprobs.content` share
one clamp (-inf is not valid JSON) and one ranking.
"""

from __future__ import annotations

from collections.abc import Callable

TokenStr = Callable[[int], str]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _lp(value: float | None) -> float | None:
    # -inf is not valid JSON; vLLM clamps the same way
    return None if value is None else max(float(value), -9999.0)


def _ranked(lp: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(lp.items(), key=lambda kv: -kv[1])


def legacy_logprobs(
    token_ids: list[int], logprobs: list[dict[int, float] | None], token_str: TokenStr, text_offset: int
) -> dict:
    """Completions' logprobs: parallel lists; `None` entries (the first prompt token) stay None."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, lp in zip(token_ids, logprobs, strict=False):
        s = token_str(tid)
        tokens.append(s)
        offsets.append(text_offset)
        text_offset += len(s)
        if lp is None:
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(_lp(lp.get(tid)))
            tops.append({token_str(t): _lp(v) for t, v in _ranked(lp)})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def merge_legacy(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}


def prompt_logprobs_json(
    token_ids: list[int], logprobs: list[dict[int, float] | None] | None, top_n: int, token_str: TokenStr
) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first (nothing before it to score),
    else {"id": {"logprob", "rank", "decoded_token"}} for the token itself and the `top_n` most
    likely. A rank is the place among those (1 = the most likely); the prompt token's own is null
    when it is not among them (its place is not computed)."""
    if logprobs is None:
        return None
    out: list[dict | None] = []
    for tid, lp in zip(token_ids, logprobs, strict=False):
        if lp is None:
            out.append(None)
            continue
        in_top = len(lp) <= top_n  # the scored token is one of the top N (else it was added to them)
        ranked = [t for t, _ in _ranked(lp) if in_top or t != tid]
        out.append(
            {
                str(t): {
                    "logprob": _lp(v),
                    "rank": ranked.index(t) + 1 if t in ranked else None,
                    "decoded_token": token_str(t),
                }
                for t, v in lp.items()
            }
        )
    return out


def chat_logprobs(
    token_ids: list[int], logprobs: list[dict[int, float]], token_str: TokenStr, top_n: int
) -> list[dict]:
    """Chat's logprobs.content entries: the sampled token plus its `top_n` alternatives."""

    def entry(tid: int, value: float | None) -> dict:
        s = token_str(tid)
        return {"token": s, "logprob": _lp(value), "bytes": list(s.encode("utf-8"))}

    content = []
    for tid, lp in zip(token_ids, logprobs, strict=False):
        item = entry(tid, lp.get(tid))
        item["top_logprobs"] = [entry(t, v) for t, v in _ranked(lp)[:top_n]]
        content.append(item)
    return content
