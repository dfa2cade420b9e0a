"""The `long_context_accuracy` block (ACC-12): needle-in-a-haystack retrieval at given lengths.

Config (CVS's cell schema, plus atomc's `lengths` and `depths`):
  {"cells": [{"id": "4k", "isl": 4096, "osl": 32, "num_prompts": 8, "seed": 42}]}
  - `isl`: the prompt length in tokens; `lengths: [..]` runs several in one cell.
  - `depths`: where the needle sits, as fractions of the haystack (0 = first sentence, 1 = last);
    default: `num_prompts` depths spread evenly from 0 to 1. Prompt i of a length uses depth
    i mod len(depths), so num_prompts 8 over 4 depths is two needles per depth.
  - `osl`: max tokens of the answer; `endpoint`: "completions" (default) or "chat";
    `num_concurrent`: requests in flight (default 4).

Each prompt is filler text generated from the cell's seed (plain sentences that say nothing about
the needle), one needle sentence ("The secret number of <city> is <7 digits>.") at its depth, and
the question. A prompt passes when the answer contains the needle's number; the cell's metric is
the fraction that pass, named as CVS names it: `accuracy.niah_pass_rate__<id>`, gated by the
threshold file's `long_context_accuracy.<id>` specs.

Lengths are counted with the server's tokenizer: `POST /tokenize` (vLLM, SGLang) when the server
has it, else the `usage.prompt_tokens` of a one-token completion (atomc serve, any OpenAI server),
else 4 characters a token. Each row says which (`length_source`) and also records the prompt
tokens the server reported for the real requests.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

from atomc.bench.blocks import BlockResult, SuiteContext
from atomc.bench.client import auth_headers
from atomc.bench.thresholds import Status, describe_threshold, evaluate

BLOCK = "long_context_accuracy"
FIELDS = {"id", "isl", "osl", "num_prompts", "seed", "lengths", "depths", "endpoint", "num_concurrent"}
CHARS_PER_TOKEN = 4.0  # the estimate when the server cannot count
REQUEST_TIMEOUT_S = 600.0  # one answer: a long prefill on a loaded server, not a hang

CITIES = [
    "Lisbon",
    "Oslo",
    "Nairobi",
    "Lima",
    "Hanoi",
    "Quito",
    "Tbilisi",
    "Dakar",
    "Perth",
    "Bergen",
    "Cusco",
    "Accra",
    "Riga",
    "Porto",
    "Kyoto",
    "Tunis",
]
SUBJECTS = [
    "The old ferry",
    "A quiet library",
    "The morning market",
    "A narrow bridge",
    "The river valley",
    "A village bakery",
    "The tram line",
    "A stone lighthouse",
    "The hill garden",
    "A small orchestra",
]
VERBS = [
    "opened",
    "closed",
    "was repainted",
    "welcomed visitors",
    "stayed busy",
    "grew quieter",
    "was repaired",
    "changed its hours",
    "drew a crowd",
    "was photographed",
]
TIMES = [
    "early in spring",
    "after the long rains",
    "during the festival",
    "on a windy afternoon",
    "late in the evening",
    "before the harvest",
    "in the first week of winter",
    "at dawn",
]
DETAILS = [
    "People talked about it for days.",
    "Nobody seemed to mind.",
    "The weather stayed mild.",
    "Tea was served outside.",
    "A few children watched from the steps.",
    "The bells rang twice.",
]
INSTRUCTION = "Find the secret number in this text.\n\n"


class NiahSpecError(ValueError):
    pass


# --- prompts -----------------------------------------------------------------------------------


def filler_sentences(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(TIMES)}."
        out.append(s + (" " + rng.choice(DETAILS) if rng.random() < 0.3 else ""))
    return out


def needle(rng: random.Random) -> tuple[str, str, str]:
    """(city, number, sentence): a 7-digit number, so a random guess essentially never matches."""
    city = rng.choice(CITIES)
    number = str(rng.randint(1_000_000, 9_999_999))
    return city, number, f"The secret number of {city} is {number}."


def question(city: str, chat: bool) -> str:
    if chat:
        return f"\n\nWhat is the secret number of {city}? Reply with the number only."
    # a completion prompt ends where the answer starts, so a base model can simply continue
    return f"\n\nQuestion: What is the secret number of {city}?\nAnswer: The secret number of {city} is"


def build_prompt(filler: list[str], depth: float, needle_sentence: str, city: str, chat: bool) -> str:
    """The needle goes between filler sentences at `depth` (0: before the first, 1: after the last)."""
    at = round(depth * len(filler))
    body = " ".join([*filler[:at], needle_sentence, *filler[at:]])
    return INSTRUCTION + body + question(city, chat)


def retrieved(answer: str, number: str) -> bool:
    # digits only: "1,234,567" or "1 234 567" count; a longer number that merely contains it does not
    return number in re.findall(r"\d+", re.sub(r"(?<=\d)[,\s](?=\d)", "", answer or ""))


def spread_depths(n: int) -> list[float]:
    return [0.5] if n <= 1 else [i / (n - 1) for i in range(n)]


# --- counting tokens ---------------------------------------------------------------------------


class TokenCounter:
    """Counts a prompt's tokens with the server's tokenizer, by the best means the server has."""

    def __init__(self, client: httpx.Client, base_url: str, model: str):
        self.client, self.base_url, self.model = client, base_url.rstrip("/"), model
        self.source = self._detect()

    def _tokenize(self, text: str) -> int | None:
        try:
            r = self.client.post(f"{self.base_url}/tokenize", json={"model": self.model, "prompt": text})
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        body = r.json()
        if isinstance(body.get("count"), int):
            return body["count"]
        return len(body["tokens"]) if isinstance(body.get("tokens"), list) else None

    def _usage(self, text: str) -> int | None:
        body = {"model": self.model, "prompt": text, "max_tokens": 1, "temperature": 0}
        try:
            r = self.client.post(f"{self.base_url}/v1/completions", json=body)
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        n = (r.json().get("usage") or {}).get("prompt_tokens")
        return n if isinstance(n, int) else None

    def _detect(self) -> str:
        probe = "The quick brown fox jumps over the lazy dog."
        if self._tokenize(probe) is not None:
            return "tokenize"
        if self._usage(probe) is not None:
            return "usage"
        return "estimate"

    def count(self, text: str) -> int | None:
        """Tokens in `text`; None when the server refused it (a prompt longer than its context)."""
        if self.source == "tokenize":
            return self._tokenize(text)
        if self.source == "usage":
            return self._usage(text)
        return math.ceil(len(text) / CHARS_PER_TOKEN)


def fit_filler(target: int, seed: int, count: Callable[[str], int | None], chat: bool) -> tuple[list[str], int]:
    """The longest seeded filler whose prompt (a needle in the middle) is at most `target` tokens,
    and that prompt's length: a linear guess from a short calibration, then guesses from the
    measured error, bisecting once a length was too long (or refused)."""
    # measured with the longest city name (it appears up to three times), so the real prompts,
    # each with its own needle, come out at or just under the target
    _city, number, _sentence = needle(random.Random(seed))
    city = max(CITIES, key=len)
    sentence = f"The secret number of {city} is {number}."

    def measure(k: int) -> int | None:
        return count(build_prompt(filler_sentences(seed, k), 0.5, sentence, city, chat))

    fixed = measure(0)
    if fixed is None or fixed > target:
        raise NiahSpecError(f"length {target} is shorter than the question itself ({fixed} tokens)")
    calib = measure(8)
    per = (calib - fixed) / 8 if calib is not None and calib > fixed else 1.0
    lo, lo_n, hi = 0, fixed, None
    k = max(1, int((target - fixed) / per))
    for _ in range(16):
        n = measure(k)
        if n is not None and n <= target:
            lo, lo_n = k, n
            per = max((n - fixed) / k, 1e-3)  # the average over many sentences: a better rate
        else:
            hi = k
        if hi is not None and hi - lo <= 1:
            break
        if hi is None and target - lo_n < per:
            break  # one more sentence would not fit
        # step from the last measurement by its error; bisect when refused or when the step
        # would leave the bracket (lo fits, hi does not)
        guess = k + math.floor((target - n) / per) if n is not None else (lo + (hi or 2 * k)) // 2
        if guess <= lo:
            guess = lo + 1
        if hi is not None and guess >= hi:
            guess = (lo + hi) // 2
        k = guess
    return filler_sentences(seed, lo), lo_n


# --- running a cell ----------------------------------------------------------------------------


def validate_cells(spec: dict) -> list[dict]:
    if not isinstance(spec, dict) or not isinstance(spec.get("cells"), list):
        raise NiahSpecError("long_context_accuracy needs `cells`: a list of {id, isl, ...}")
    ids = []
    for i, cell in enumerate(spec["cells"]):
        if not isinstance(cell, dict) or not isinstance(cell.get("id"), str):
            raise NiahSpecError(f"long_context_accuracy.cells[{i}] needs a string `id`")
        unknown = sorted(k for k in cell if k not in FIELDS and not k.startswith("_"))
        if unknown:
            raise NiahSpecError(f"long_context cell {cell['id']!r}: unknown field(s) {unknown}")
        lengths = cell_lengths(cell)
        if not lengths or any(n <= 0 for n in lengths):
            raise NiahSpecError(f"long_context cell {cell['id']!r}: set `isl` or `lengths` (positive tokens)")
        depths = cell.get("depths")
        fractions = isinstance(depths, list) and all(isinstance(d, int | float) and 0 <= d <= 1 for d in depths)
        if depths is not None and (not depths or not fractions):
            raise NiahSpecError(f"long_context cell {cell['id']!r}: depths are fractions in [0, 1]")
        if cell.get("endpoint", "completions") not in ("completions", "chat"):
            raise NiahSpecError(f"long_context cell {cell['id']!r}: endpoint is 'completions' or 'chat'")
        ids.append(cell["id"])
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise NiahSpecError(f"duplicate long-context cell id(s): {', '.join(map(repr, dupes))}")
    return spec["cells"]


def cell_lengths(cell: dict) -> list[int]:
    try:
        if cell.get("lengths") is not None:
            return [int(n) for n in cell["lengths"]]
        return [int(cell["isl"])] if cell.get("isl") is not None else []
    except (TypeError, ValueError):
        raise NiahSpecError(f"long_context cell {cell.get('id')!r}: lengths must be integers") from None


def ask(client: httpx.Client, base_url: str, model: str, prompt: str, osl: int, chat: bool) -> tuple[str, int | None]:
    if chat:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": osl, "temperature": 0}
        r = client.post(f"{base_url}/v1/chat/completions", json=body)
    else:
        body = {"model": model, "prompt": prompt, "max_tokens": osl, "temperature": 0}
        r = client.post(f"{base_url}/v1/completions", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
    data = r.json()
    choice = (data.get("choices") or [{}])[0]
    text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
    return text or "", (data.get("usage") or {}).get("prompt_tokens")


def server_max_len(client: httpx.Client, base_url: str, model: str) -> int | None:
    try:
        r = client.get(f"{base_url}/v1/models")
        for m in r.json().get("data") or []:
            if m.get("id") == model and isinstance(m.get("max_model_len"), int):
                return m["max_model_len"]
    except (httpx.HTTPError, ValueError):
        pass
    return None


def run_cell(cell: dict, client: httpx.Client, ctx: SuiteContext, counter: TokenCounter, max_len: int | None) -> dict:
    chat = cell.get("endpoint") == "chat"
    osl, seed = int(cell.get("osl", 32)), int(cell.get("seed", 42))
    num_prompts = int(cell.get("num_prompts", 8))
    depths = [float(d) for d in cell.get("depths") or spread_depths(num_prompts)]
    grid: list[dict] = []
    for length in cell_lengths(cell):
        if max_len is not None and length + osl > max_len:
            reason = f"{length} + osl {osl} tokens exceed the max model length {max_len}"
            grid.append({"length": length, "status": "SKIP", "reason": reason})
            continue
        try:
            filler, measured = fit_filler(length, seed + length, counter.count, chat)
        except NiahSpecError as exc:
            grid.append({"length": length, "status": "ERROR", "reason": str(exc)})
            continue
        rng = random.Random(seed * 1_000_003 + length)
        jobs = []
        for i in range(num_prompts):
            depth = depths[i % len(depths)]
            city, number, sentence = needle(rng)
            jobs.append((depth, number, build_prompt(filler, depth, sentence, city, chat)))

        def one(job, _chat=chat):
            depth, number, prompt = job
            try:
                text, used = ask(client, ctx.base_url.rstrip("/"), ctx.model, prompt, osl, _chat)
                return depth, retrieved(text, number), used, text, None
            except (httpx.HTTPError, RuntimeError) as exc:
                return depth, False, None, "", str(exc)

        with ThreadPoolExecutor(max_workers=max(1, int(cell.get("num_concurrent", 4)))) as pool:
            answers = list(pool.map(one, jobs))
        for depth in depths:
            mine = [a for a in answers if a[0] == depth]
            if not mine:
                continue
            used = [a[2] for a in mine if a[2] is not None]
            grid.append(
                {
                    "length": length,
                    "depth": depth,
                    "prompts": len(mine),
                    "retrieved": sum(a[1] for a in mine),
                    "pass_rate": sum(a[1] for a in mine) / len(mine),
                    "length_source": counter.source,
                    "measured_tokens": measured,
                    "prompt_tokens": round(sum(used) / len(used)) if used else None,
                    "errors": [a[4] for a in mine if a[4]],
                    "example_answer": mine[0][3][:120],
                }
            )
    ran = [g for g in grid if "pass_rate" in g]
    prompts = sum(g["prompts"] for g in ran)
    errors = [e for g in ran for e in g["errors"]]
    row = {
        "id": cell["id"],
        "lengths": cell_lengths(cell),
        "depths": depths,
        "grid": grid,
        "prompts": prompts,
        "length_source": counter.source,
    }
    not_run = [g for g in grid if "pass_rate" not in g]
    if not_run:
        row["reason"] = "; ".join(f"length {g['length']}: {g['reason']}" for g in not_run)
    if any(g["status"] == "ERROR" for g in not_run):
        row.update(pass_rate=None, status="ERROR")
    elif prompts == 0:
        row.update(pass_rate=None, status="SKIP")
    elif len(errors) == prompts:
        row.update(pass_rate=None, status="ERROR", reason=f"every request failed: {errors[0]}")
    else:
        row.update(pass_rate=sum(g["retrieved"] for g in ran) / prompts, errors=len(errors))
    return row


def metric_name(cell_id: str) -> str:
    return f"accuracy.niah_pass_rate__{cell_id}"


def gate_cell(row: dict, specs) -> list[dict]:
    name = metric_name(row["id"])
    if not isinstance(specs, dict) or not any(not k.startswith("_") for k in specs):
        return [
            {
                "metric": "-",
                "threshold": "-",
                "actual": row.get("pass_rate"),
                "status": "INFO",
                "reason": "no thresholds for cell: recorded only",
            }
        ]
    out = []
    for metric, spec in specs.items():
        if metric.startswith("_"):
            continue
        actual = row.get("pass_rate") if metric == name else None
        if metric != name:
            verdict_status, reason = Status.FAIL, f"cell {row['id']!r} produces only {name!r}"
        else:
            v = evaluate(spec, actual)
            verdict_status, reason = v.status, v.reason
        out.append(
            {
                "metric": metric,
                "threshold": describe_threshold(spec),
                "actual": actual,
                "status": str(verdict_status),
                "reason": reason,
            }
        )
    return out


def run(spec: dict, ctx: SuiteContext) -> BlockResult:
    try:
        cells = validate_cells(spec)
    except NiahSpecError as exc:
        return BlockResult(BLOCK, "ERROR", f"config error: {exc}")
    if not cells:
        return BlockResult(BLOCK, "SKIP", "long_context_accuracy.cells is empty")
    thresholds = (ctx.thresholds or {}).get("long_context_accuracy") or {}
    config_max = ctx.params.get("max_model_length")
    rows, metrics = [], {}
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0)
    with httpx.Client(timeout=timeout, headers=auth_headers(ctx.api_key), trust_env=False) as client:
        counter = TokenCounter(client, ctx.base_url, ctx.model)
        max_len = server_max_len(client, ctx.base_url.rstrip("/"), ctx.model)
        if config_max is not None:
            max_len = min(int(config_max), max_len) if max_len else int(config_max)
        ctx.log(f"long_context_accuracy: counting tokens by {counter.source}; max length {max_len}")
        for cell in cells:
            try:
                row = run_cell(cell, client, ctx, counter, max_len)
            except NiahSpecError as exc:
                row = {"id": cell["id"], "grid": [], "pass_rate": None, "status": "ERROR", "reason": str(exc)}
            if row.get("pass_rate") is not None:
                metrics[metric_name(cell["id"])] = row["pass_rate"]
                row["gates"] = gate_cell(row, thresholds.get(cell["id"]))
                statuses = {g["status"] for g in row["gates"]}
                row["status"] = "FAIL" if "FAIL" in statuses else "PASS" if "PASS" in statuses else "INFO"
                failed = [f"{g['metric']} {g['reason']}" for g in row["gates"] if g["status"] == "FAIL"]
                if failed:
                    row["reason"] = "; ".join(failed)
            else:
                row["gates"] = []
            rows.append(row)
    if any(r["status"] == "ERROR" for r in rows):
        verdict = "ERROR"
    elif any(r["status"] == "FAIL" for r in rows):
        verdict = "FAIL"
    elif all(r["status"] == "SKIP" for r in rows):
        verdict = "SKIP"
    else:
        verdict = "PASS"
    noted = [r for r in rows if r["status"] in ("FAIL", "ERROR", "SKIP")]
    reason = "; ".join(f"{r['id']}: {r.get('reason') or r['status']}" for r in noted)
    summary = ", ".join(f"{r['id']} {r['pass_rate']:.2f}" for r in rows if r.get("pass_rate") is not None)
    return BlockResult(BLOCK, verdict, reason or f"pass rates: {summary}", metrics=metrics, rows=rows)
