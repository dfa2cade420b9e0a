"""MTP / speculative-decoding quality (ACC-4/5/13): draft acceptance, read from the server's metrics.

The acceptance figures come from the server's own Prometheus counters (`GET /metrics`), named as
vLLM names them (`<prefix>:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`,
`..._num_accepted_tokens_per_pos{position}`; any prefix, so atomc, vLLM and ATOM builds that follow
the names all work). Read after the sweep, so they cover every measured request. A server that
exports none (atomc has no speculative decoding yet) makes the block SKIP with that reason.

The config's chat probe (`chat_template_prompt`) is sent once: an empty or repetitive answer (the
usual sign of a broken draft model) is reported, and with `chat_template_expected_sha256` set the
answer's hash is compared (1.0 / 0.0 in `mtp.chat_template_ok`).
"""

from __future__ import annotations

import hashlib
import re

import httpx
from prometheus_client.parser import text_string_to_metric_families

from atomc.bench.blocks import BlockResult, SuiteContext
from atomc.bench.client import auth_headers

_SPEC = re.compile(
    r"^[A-Za-z_][A-Za-z0-9_]*:spec_decode_(num_drafts|num_draft_tokens|num_accepted_tokens|num_accepted_tokens_per_pos)(_total)?$"
)
_REPEAT = re.compile(r"(.{1,32})\1{4,}", re.S)


def spec_decode_counters(metrics_text: str) -> tuple[dict[str, float], dict[int, float]]:
    """Totals of the spec-decode counters ({kind: value}) and accepted tokens per draft position."""
    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            m = _SPEC.match(sample.name)
            if not m or sample.name.endswith("_created"):
                continue
            kind = m.group(1)
            if kind == "num_accepted_tokens_per_pos":
                pos = int(sample.labels.get("position", -1))
                per_pos[pos] = per_pos.get(pos, 0.0) + sample.value
            else:
                totals[kind] = totals.get(kind, 0.0) + sample.value
    return totals, per_pos


def acceptance_metrics(totals: dict[str, float], per_pos: dict[int, float]) -> dict[str, float]:
    """acceptance rate (accepted / drafted tokens), mean acceptance length (1 + accepted / drafts:
    tokens gained per target step) and the acceptance rate at each draft position."""
    out: dict[str, float] = {}
    drafts, drafted, accepted = (totals.get(k) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
    if drafted:
        out["mtp.acceptance_rate"] = accepted / drafted if accepted is not None else 0.0
    if drafts:
        out["mtp.mean_acceptance_length"] = 1.0 + (accepted or 0.0) / drafts
        for pos, n in sorted(per_pos.items()):
            out[f"mtp.acceptance_rate_pos{pos}"] = n / drafts
    for kind, value in totals.items():
        out[f"mtp.{kind}"] = value
    return out


def degenerate(text: str) -> bool:
    stripped = (text or "").strip()
    return len(stripped) < 8 or _REPEAT.search(stripped) is not None


def _chat_probe(spec: dict, ctx: SuiteContext, http: httpx.Client) -> tuple[dict[str, float], list[dict]]:
    prompt = spec.get("chat_template_prompt")
    if not prompt:
        return {}, []
    body = {
        "model": ctx.model,
        "messages": [{"role": "user", "content": str(prompt)}],
        "max_tokens": 64,
        "temperature": 0,
    }
    r = http.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    text = str(((r.json().get("choices") or [{}])[0].get("message") or {}).get("content") or "")
    digest = hashlib.sha256(text.strip().encode()).hexdigest()
    metrics = {"mtp.degenerate_decode": 1.0 if degenerate(text) else 0.0}
    expected = str(spec.get("chat_template_expected_sha256") or "").strip().lower()
    if expected:
        metrics["mtp.chat_template_ok"] = 1.0 if digest == expected else 0.0
    return metrics, [{"check": "chat_probe", "text": text[:200], "sha256": digest}]


def run(spec: dict, ctx: SuiteContext) -> BlockResult:
    with httpx.Client(base_url=ctx.base_url, headers=auth_headers(ctx.api_key), timeout=120.0, trust_env=False) as http:
        r = http.get("/metrics")
        if r.status_code != 200:
            return BlockResult("mtp_quality", "SKIP", f"the server has no /metrics (HTTP {r.status_code})")
        totals, per_pos = spec_decode_counters(r.text)
        if not totals:
            return BlockResult(
                "mtp_quality", "SKIP",
                "the server exports no speculative-decoding metrics (*:spec_decode_*); "
                "atomc has no speculative decoding yet",
            )  # fmt: skip
        metrics = acceptance_metrics(totals, per_pos)
        probe_metrics, rows = _chat_probe(spec, ctx, http)
    metrics.update(probe_metrics)
    rows.insert(0, {"check": "spec_decode_counters", **{k: v for k, v in metrics.items() if k.startswith("mtp.num")}})
    if metrics.get("mtp.degenerate_decode") == 1.0:
        return BlockResult("mtp_quality", "FAIL", "the chat probe's answer is empty or repetitive", metrics, rows)
    if metrics.get("mtp.chat_template_ok") == 0.0:
        return BlockResult(
            "mtp_quality", "FAIL", "the chat probe's answer differs from chat_template_expected_sha256", metrics, rows
        )
    rate = metrics.get("mtp.acceptance_rate")
    reason = f"acceptance rate {rate:.3f}" if rate is not None else "counters read; no draft tokens yet"
    return BlockResult("mtp_quality", "PASS", reason, metrics, rows)
