"""Structured outputs on xgrammar: grammars compiled once per constraint, a matcher per sequence,
and the token bitmask of a step's constrained rows.

- `GrammarCompiler` turns a `StructuredOutputsParams` (json schema, regex, choice, EBNF grammar,
  json_object) into an xgrammar `CompiledGrammar` for the served tokenizer. Compiled grammars are
  cached by (kind, value, whitespace): a schema that every request sends is compiled once. The
  tokenizer's vocabulary is padded to the model's logits width (`vocab_size`), which can be wider
  than the tokenizer (padded embedding rows): those ids are never allowed. A constraint xgrammar
  cannot compile raises `GrammarError` (a ValueError) naming its kind, which the server turns into
  a 400 at request time (it compiles in the request path, on an executor, not on the engine loop).
- `SequenceGrammar` is one sequence's matcher: it accepts each token the engine appends, fills that
  sequence's row of the next step's bitmask, and says when the grammar is complete (EOS is allowed
  only then; the matcher's stop tokens are the engine's EOS ids). It tracks the output tokens by
  count, so a path that recomputes a sequence (preemption, a prefix-cache hit) changes nothing: the
  tokens are the same, and the matcher never saw KV state. `sync(output_ids)` accepts what it has
  not seen and rebuilds from scratch if the output ever became shorter than what it accepted.
- `fill_bitmask` fills the rows of one step, one matcher after the other (why: its docstring).

xgrammar imports transformers (about a second on a warm machine, much more on a cold one), so it is
imported only when a first constraint is compiled: an engine that never sees one never pays for it.
`available()` says whether it is installed without importing it.
"""

from __future__ import annotations

import importlib.util
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from atomc.sampling_params import StructuredOutputsParams

CACHE_ENTRIES = 1024  # distinct constraints kept compiled (LRU)


class GrammarError(ValueError):
    """A constraint the grammar engine cannot compile; `kind` is json, regex, choice, grammar or json_object."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"invalid {kind} constraint: {message}")
        self.kind = kind


def available() -> bool:
    """Is xgrammar installed? (Checked without importing it.)"""
    return importlib.util.find_spec("xgrammar") is not None


def _xgr():
    import xgrammar

    return xgrammar


_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")


def _clean(e: Exception) -> str:
    """xgrammar's message without its C++ location prefix (`[15:24:15] /project/cpp/x.cc:12: `)."""
    return _XGR_PREFIX.sub("", str(e).strip()).strip() or type(e).__name__


def bound_strings(schema: Any) -> Any:
    """`schema` with each length-bounded string (`minLength` / `maxLength`, no `pattern`) given the
    same bounds as a pattern of characters JSON allows unescaped. xgrammar 0.2 compiles the length
    bounds to a rule that lets raw control characters through (invalid JSON, and a weak model finds
    them); its patterns exclude them. The price: such a string cannot hold an escape (a quote, a
    backslash, a newline)."""
    if isinstance(schema, list):
        return [bound_strings(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bound_strings(v) for k, v in schema.items()}
    types = out.get("type")
    is_string = types == "string" or (isinstance(types, list) and types == ["string"])
    lo, hi = out.get("minLength"), out.get("maxLength")
    bounded = isinstance(lo, int) or isinstance(hi, int)
    if is_string and bounded and "pattern" not in out and "format" not in out:
        lo = lo if isinstance(lo, int) and lo > 0 else 0
        hi = str(hi) if isinstance(hi, int) else ""
        out.pop("minLength", None)
        out.pop("maxLength", None)
        out["pattern"] = r'^[^"\\\x00-\x1f]{' + f"{lo},{hi}" + "}$"
    return out


def cache_key(so: StructuredOutputsParams) -> tuple:
    """What makes two constraints compile to the same grammar."""
    kind = so.kind
    value: Any = getattr(so, kind)
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise GrammarError("json", f"the schema is not valid JSON: {e}") from None
        if not isinstance(value, dict | bool):
            raise GrammarError("json", f"a JSON schema must be an object, got {type(value).__name__}")
        value = json.dumps(bound_strings(value), sort_keys=True, separators=(",", ":"))
    elif kind == "choice":
        value = tuple(value)
    elif kind == "json_object":
        value = True
    return kind, value, bool(so.disable_any_whitespace)


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of `choices` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe (the server's executor and the engine's
    compile thread share one in an in-process server)."""

    def __init__(self, tokenizer: Any | Callable[[], Any], vocab_size: int, stop_token_ids: list[int] | None = None):
        """`tokenizer`: a transformers tokenizer, or a function that loads one (called on the first
        compile: an engine process holds only a decoding tokenizer). `vocab_size`: the model's logits
        width. `stop_token_ids`: what ends a sequence (EOS), allowed once a grammar is complete."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids or [])
        self._compiler = None
        self.mask_vocab_size = vocab_size
        self._init_lock = threading.Lock()
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self.num_compiles = 0  # cache misses (the tests read it)

    def _xgr_compiler(self):
        if self._compiler is not None:  # every constrained step asks (bitmask_width): no lock then
            return self._compiler
        with self._init_lock:
            if self._compiler is None:
                xgr = _xgr()
                tok = self._tokenizer
                if not hasattr(tok, "get_vocab"):  # a loader, not the tokenizer itself
                    tok = self._tokenizer = tok()
                # the bitmask covers the wider of the logits and the tokenizer (ids past the
                # logits are never sampled; ids past the tokenizer are never allowed)
                self.mask_vocab_size = max(self.vocab_size, len(tok))
                info = xgr.TokenizerInfo.from_huggingface(
                    tok, vocab_size=self.mask_vocab_size, stop_token_ids=self.stop_token_ids or None
                )
                # atomc keeps its own LRU of compiled grammars; xgrammar's cache would hold them twice
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            return self._compiler

    def bitmask_width(self) -> int:
        """int32 words per bitmask row (loads the tokenizer on first use)."""
        self._xgr_compiler()
        return bitmask_width(self.mask_vocab_size)

    def cached(self, so: StructuredOutputsParams) -> Any | None:
        """The compiled grammar if it is in the cache (no compile), else None."""
        key = cache_key(so)
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
            return grammar

    def compile(self, so: StructuredOutputsParams) -> Any:
        """The compiled grammar of `so`, from the cache or compiled now; GrammarError if it cannot be."""
        key = cache_key(so)
        hit = self.cached(so)
        if hit is not None:
            return hit
        compiler = self._xgr_compiler()
        kind, value, compact = key
        try:
            if kind == "json":
                grammar = compiler.compile_json_schema(value, any_whitespace=not compact)
            elif kind == "json_object":
                grammar = compiler.compile_json_schema('{"type": "object"}', any_whitespace=not compact)
            elif kind == "regex":
                grammar = compiler.compile_regex(value)
            elif kind == "choice":
                grammar = compiler.compile_grammar(choice_ebnf(list(value)))
            else:
                grammar = compiler.compile_grammar(value)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(kind, _clean(e)) from None
        with self._lock:
            self.num_compiles += 1
            self._cache[key] = grammar
            self._cache.move_to_end(key)
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, so: StructuredOutputsParams, stop_token_ids: list[int]) -> SequenceGrammar:
        return SequenceGrammar(self.compile(so), stop_token_ids)


class SequenceGrammar:
    """One sequence's position in its grammar."""

    def __init__(self, compiled: Any, stop_token_ids: list[int]):
        self._compiled, self._stops = compiled, list(stop_token_ids)
        self.matcher = self._new_matcher()
        self.num_accepted = 0  # output tokens the matcher has taken
        self.rejected: int | None = None  # a token the grammar refused (the sampler fell back), if any

    def _new_matcher(self):
        return _xgr().GrammarMatcher(self._compiled, override_stop_tokens=self._stops or None)

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False (and `rejected` set) if the grammar refuses it."""
        ok = self.matcher.accept_token(token)
        if ok:
            self.num_accepted += 1
        else:
            self.rejected = token
        return ok

    def sync(self, output_ids: list[int]) -> bool:
        """Take the output tokens not accepted yet; if the output is shorter than what was accepted
        (tokens dropped), start over from the first one. False if a token is refused."""
        if len(output_ids) < self.num_accepted:
            self.matcher = self._new_matcher()
            self.num_accepted = 0
        for token in output_ids[self.num_accepted :]:
            if not self.accept(token):
                return False
        return True

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted: the grammar is complete and the sequence ends."""
        return self.matcher.is_terminated()

    @property
    def is_completed(self) -> bool:
        """The output so far is a complete match (it may still continue, e.g. more digits)."""
        return self.matcher.is_completed()

    def fill(self, bitmask, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


def fill_bitmask(grammars: list[SequenceGrammar | None], bitmask, rows: list[int] | None = None) -> None:
    """Fill row `rows[i]` (row i when `rows` is None) of `bitmask` (int32, [rows, ceil(V / 32)], on
    the host) with the tokens grammar i allows next; a row whose grammar is None or terminated
    allows every token (its row is dropped by the engine, or unconstrained). Other rows are not
    written.

    One matcher after the other: xgrammar's batch matcher spreads the rows over threads, but on the
    H200's 16-core host it took 5.4 ms a step for 64 rows of a JSON schema against 1.5 ms for this
    loop (benchmarks/structured_steps.py, docs/performance.md section 8), its threads costing more
    than the ~15 us a row's fill takes."""
    rows = list(range(len(grammars))) if rows is None else rows
    for row, g in zip(rows, grammars, strict=True):
        if g is None or g.matcher.is_terminated():
            bitmask[row].fill_(-1)
        else:
            g.matcher.fill_next_token_bitmask(bitmask, row)


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32
