"""Reading a CVS ATOM config file's layers, before any field is interpreted.

The page's rules, in the order the loader applies them: keys starting with `_` are dropped at
every level; a `schema_version: 2` file's profile is merged over its shared top-level fields (a
flat file is the implicit profile `perf`); `{user-id}`, `{shared_fs}` and `{paths.*}` are
substituted in every string. `SweepConfigError` lives here because every later step (params,
cells, the whole config, threshold files) raises it too.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

from atomc import env


class SweepConfigError(ValueError):
    pass


DEFAULT_PROFILE = "perf"
PLACEHOLDER = re.compile(r"\{(user-id|shared_fs|paths\.[A-Za-z0-9_]+)\}")


def strip_private_keys(obj):
    """Drop `_comment`-style keys at every level, as the CVS loader does."""
    if isinstance(obj, dict):
        return {k: strip_private_keys(v) for k, v in obj.items() if not str(k).startswith("_")}
    if isinstance(obj, list):
        return [strip_private_keys(v) for v in obj]
    return obj


def deep_merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`; nested dicts merge, anything else is replaced."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def select_profile(raw: dict, requested: str | None, where: Path) -> tuple[str, dict]:
    """The profile's view of the config: top-level fields with the profile's on top."""
    version = str(raw.get("schema_version", 1))
    name = requested or env.config_profile()
    if version == "1":
        if "profiles" in raw:
            raise SweepConfigError(f"{where}: 'profiles' needs schema_version 2 (this file says 1)")
        if name and name != DEFAULT_PROFILE:
            raise SweepConfigError(
                f"{where}: a flat schema_version 1 file has only the implicit profile "
                f"{DEFAULT_PROFILE!r}; profile {name!r} was asked for (--config-profile or CVS_CONFIG_PROFILE)"
            )
        return DEFAULT_PROFILE, raw
    if version != "2":
        raise SweepConfigError(f"{where}: schema_version must be 1 (flat) or 2 (profiles), got {version}")
    profiles = raw.get("profiles")
    if not isinstance(profiles, dict) or not profiles:
        raise SweepConfigError(f"{where}: schema_version 2 needs a non-empty 'profiles' object")
    name = name or raw.get("default_profile") or DEFAULT_PROFILE
    if name not in profiles:
        raise SweepConfigError(f"{where}: no profile {name!r}; profiles: {', '.join(sorted(profiles))}")
    shared = {k: v for k, v in raw.items() if k not in ("profiles", "default_profile")}
    if not isinstance(profiles[name], dict):
        raise SweepConfigError(f"{where}: profile {name!r} must be an object")
    return name, deep_merge(shared, profiles[name])


def substitute(obj, paths: dict[str, str]):
    """Replace the page's placeholders in every string (the `threshold_json` key is skipped by the caller)."""

    def one(text: str) -> str:
        def repl(m: re.Match) -> str:
            name = m.group(1)
            if name == "user-id":
                return env.user_name()
            key = "shared_fs" if name == "shared_fs" else name.split(".", 1)[1]
            if key not in paths:
                raise SweepConfigError(f"placeholder {m.group(0)} names no key of 'paths'")
            return paths[key]

        return PLACEHOLDER.sub(repl, text)

    if isinstance(obj, str):
        return one(obj)
    if isinstance(obj, dict):
        return {k: substitute(v, paths) for k, v in obj.items()}
    if isinstance(obj, list):
        return [substitute(v, paths) for v in obj]
    return obj


def resolve_paths(paths: dict) -> dict[str, str]:
    """`paths` values may refer to each other (`{shared_fs}`, `{paths.x}`) and to `{user-id}`."""
    out = {k: str(v) for k, v in (paths or {}).items()}
    for _ in range(len(out) + 1):  # each pass resolves one more level of reference
        new = {k: substitute(v, out) for k, v in out.items()}
        if new == out:
            return out
        out = new
    raise SweepConfigError(f"paths refer to each other in a cycle: {sorted(out)}")
