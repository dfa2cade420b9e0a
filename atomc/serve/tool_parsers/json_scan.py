"""A tolerant scanner for JSON that may still be arriving: where a value ends (or that it has not
ended yet), and the fields of an object read so far.

The tool-call parsers stream a call's arguments as the model writes them, so they need the span
of the `arguments` value inside a half-written object, not a decoded value: `json.loads` can only
say "not valid yet". Values are never decoded here except keys and complete strings; the raw text
of a value is what streams, so the pieces a client concatenates are exactly the model's JSON.
A malformed prefix (one that no continuation can make valid) raises ValueError.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_WS = " \t\r\n"
_SCALAR_END = ",}] \t\r\n"
_WORDS = ("true", "false", "null")
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_NUMBER_PREFIX = re.compile(r"-?((0|[1-9][0-9]*)(\.[0-9]*)?([eE][-+]?[0-9]*)?)?")


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def value_end(s: str, i: int) -> int | None:
    """The index just past the JSON value starting at `s[i]`; None when `s` ends inside it (what
    is there so far is a valid beginning); ValueError when no continuation can make it valid."""
    try:
        return _value(s, i)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _value(s: str, i: int) -> int | None:
    if i >= len(s):
        return None
    c = s[i]
    if c == '"':
        return _string_end(s, i)
    if c == "{":
        return _container(s, i, "}", keyed=True)
    if c == "[":
        return _container(s, i, "]", keyed=False)
    j = i
    while j < len(s) and s[j] not in _SCALAR_END:
        j += 1
    word = s[i:j]
    if j == len(s):  # may still grow: only a valid beginning is acceptable
        if not any(w.startswith(word) for w in _WORDS) and not _NUMBER_PREFIX.fullmatch(word):
            raise ValueError(f"{word!r} does not begin a JSON value")
        return None
    if word not in _WORDS and not _NUMBER.fullmatch(word):
        raise ValueError(f"{word!r} is not a JSON value")
    return j


def _container(s: str, i: int, close: str, keyed: bool) -> int | None:
    i = skip_ws(s, i + 1)
    if i < len(s) and s[i] == close:
        return i + 1
    while True:
        if i >= len(s):
            return None
        if keyed:
            if s[i] != '"':
                raise ValueError("expected a key")
            i = _string_end(s, i)
            if i is None:
                return None
            i = skip_ws(s, i)
            if i >= len(s):
                return None
            if s[i] != ":":
                raise ValueError("expected ':' after a key")
            i = skip_ws(s, i + 1)
        end = _value(s, i)
        if end is None:
            return None
        i = skip_ws(s, end)
        if i >= len(s):
            return None
        if s[i] == close:
            return i + 1
        if s[i] != ",":
            raise ValueError(f"expected ',' or {close!r}")
        i = skip_ws(s, i + 1)


def _string_end(s: str, i: int) -> int | None:
    j = i + 1
    while j < len(s):
        ch = s[j]
        if ch == "\\":
            j += 2
            continue
        if ch == '"':
            return j + 1
        j += 1
    return None


@dataclass
class ObjectScan:
    """The fields of a JSON object read so far: key -> (value start, value end or None)."""

    fields: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    end: int | None = None  # just past the closing brace, once it came

    def raw(self, s: str, key: str) -> str | None:
        span = self.fields.get(key)
        if span is None:
            return None
        start, end = span
        return s[start : len(s) if end is None else end]

    def string(self, s: str, key: str) -> str | None:
        """A string field's value, once the whole string is in; else None."""
        span = self.fields.get(key)
        if span is None or span[1] is None or s[span[0]] != '"':
            return None
        return json.loads(s[span[0] : span[1]])


def scan_object(s: str, i: int) -> ObjectScan:
    """Read the object starting at `s[i]` (a `{`) as far as `s` goes."""
    if i >= len(s) or s[i] != "{":
        raise ValueError("expected a JSON object")
    out = ObjectScan()
    i = skip_ws(s, i + 1)
    if i < len(s) and s[i] == "}":
        out.end = i + 1
        return out
    while i < len(s):
        if s[i] != '"':
            raise ValueError("expected a key")
        key_end = _string_end(s, i)
        if key_end is None:
            return out
        key = json.loads(s[i:key_end])
        i = skip_ws(s, key_end)
        if i >= len(s):
            return out
        if s[i] != ":":
            raise ValueError("expected ':' after a key")
        i = skip_ws(s, i + 1)
        if i >= len(s):
            return out
        end = value_end(s, i)
        out.fields[key] = (i, end)
        if end is None:
            return out
        i = skip_ws(s, end)
        if i >= len(s):
            return out
        if s[i] == "}":
            out.end = i + 1
            return out
        if s[i] != ",":
            raise ValueError("expected ',' or '}' after a value")
        i = skip_ws(s, i + 1)
    return out


def hold_back(text: str, marker: str) -> str:
    """`text` without a tail that could be the beginning of `marker` (streaming must not emit a
    half-arrived marker as content)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return text[:-k]
    return text
