"""Load a CVS ATOM config for `atomc bench sweep`: flat `schema_version: 1` or profiles (`2`).

The rules are those of the CVS ATOM reference page, so a lab's files work unchanged:
- `schema_version: 2` files hold shared fields at the top and job shapes under `profiles`; one is
  picked by `--config-profile`, else `CVS_CONFIG_PROFILE`, else `default_profile`, else `perf`.
  A flat file is the implicit profile `perf`.
- keys starting with `_` are ignored at every level;
- `{user-id}`, `{shared_fs}` and `{paths.*}` are substituted in every string (not in
  `threshold_json`, a literal file name next to the config);
- every `params` field is either honoured or rejected with a message naming it: `PARAMS` says
  what each one does here. Nothing in a config is silently dropped.
The file's layers are read by config_file.py, `params` by config_params.py, the cells by
config_cells.py; this module puts them together and finds the threshold file (its names are the
ones the rest of atomc imports). Threshold coverage (`enforce_thresholds`) is checked in
`thresholds.py`, once the threshold file is known (`--threshold` may replace it).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from atomc.bench.config_cells import SweepCell, build_cells, cell_key, cells_past_max_len
from atomc.bench.config_file import (
    DEFAULT_PROFILE,
    SweepConfigError,
    resolve_paths,
    select_profile,
    strip_private_keys,
    substitute,
)
from atomc.bench.config_params import (
    EXTERNAL_DRIVERS,
    NATIVE_DRIVERS,
    PARAMS,
    client_timeout_s,
    parse_params,
    server_ready_timeout_s,
)

__all__ = [
    "BLOCK_KEYS", "DEFAULT_PROFILE", "EXTERNAL_DRIVERS", "NATIVE_DRIVERS", "PARAMS", "TOP_LEVEL_KEYS",
    "SweepCell", "SweepConfig", "SweepConfigError", "build_cells", "cell_key", "cells_past_max_len",
    "client_timeout_s", "load_sweep_config", "load_thresholds", "parse_params", "resolve_threshold_path",
    "server_ready_timeout_s", "strip_private_keys",
]  # fmt: skip

TOP_LEVEL_KEYS = {
    "schema_version", "framework", "gpu_arch", "default_profile", "profiles", "enforce_thresholds",
    "threshold_json", "paths", "model", "container", "roles", "params", "sweep", "run_card",
    "functional", "platform", "accuracy", "long_context_accuracy", "mtp_quality", "quant_parity",
}  # fmt: skip
# the optional blocks the suite knows; blocks/registry.py maps each to the module that runs it
BLOCK_KEYS = ("functional", "platform", "accuracy", "long_context_accuracy", "mtp_quality", "quant_parity")


# --- the whole config -------------------------------------------------------------------------


@dataclass
class SweepConfig:
    path: Path
    model_id: str | None
    params: dict
    cells: list[SweepCell]
    enforce_thresholds: bool = False
    threshold_json: str | None = None
    server_args: list[str] = field(default_factory=list)
    server_env: dict[str, str] = field(default_factory=dict)
    profile: str = DEFAULT_PROFILE
    schema_version: int = 1
    framework: str = "atom"
    gpu_arch: str | None = None
    run_card: dict = field(default_factory=dict)
    blocks: dict[str, dict] = field(default_factory=dict)  # functional, platform, accuracy, ... as configured
    notes: list[str] = field(default_factory=list)  # fields read but with no effect here, said once

    @property
    def driver(self) -> str:
        return self.params["driver"]

    @property
    def native(self) -> bool:
        return self.driver in NATIVE_DRIVERS

    def sibling_threshold_path(self) -> Path | None:
        return self.path.parent / self.threshold_json if self.threshold_json else None


def split_args(value, where: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return shlex.split(value)
    if isinstance(value, list):
        return [str(v) for v in value]
    raise SweepConfigError(f"{where} must be a string or a list, got {value!r}")


def _server_role(raw: dict, params: dict, notes: list[str]) -> tuple[list[str], dict[str, str]]:
    server = ((raw.get("roles") or {}).get("server")) or {}
    known = {"atom_args", "serve_args", "sglang_args", "env", "ib_hca_devices", "ib_netdev"}
    unknown = sorted(set(server) - known)
    if unknown:
        raise SweepConfigError(f"unknown roles.server fields {unknown}; known: {', '.join(sorted(known))}")
    args = split_args(server.get("atom_args"), "roles.server.atom_args")
    env_vars = server.get("env") or {}
    if not isinstance(env_vars, dict):
        raise SweepConfigError("roles.server.env must be an object of NAME: value")
    for name in ("serve_args", "sglang_args"):
        if server.get(name):
            notes.append(f"roles.server.{name} is not used: atomc starts no {params['driver']} server (you start it)")
    for name in ("ib_hca_devices", "ib_netdev"):
        if server.get(name):
            notes.append(f"roles.server.{name} is not used: atomc launches no multi-node server yet")
    return args, {str(k): str(v) for k, v in env_vars.items()}


def _check_topology(params: dict) -> None:
    nn, pp, driver = params["nnodes"], params["pipeline_parallel_size"], params["driver"]
    if nn > 1 and not params["master_addr"] and driver in NATIVE_DRIVERS:
        raise SweepConfigError(f"params.nnodes={nn} needs params.master_addr (the head node's address)")
    if driver in EXTERNAL_DRIVERS and pp > 1 and nn == 1:
        raise SweepConfigError(f"params.pipeline_parallel_size={pp} > 1 needs params.nnodes > 1 for driver {driver!r}")
    if driver in NATIVE_DRIVERS and nn > 1 and pp > 1:
        raise SweepConfigError(
            "params.driver='atom' with nnodes > 1 cannot run pipeline parallel; "
            "use driver vllm_atom or sglang for PP > 1"
        )


def load_sweep_config(path: str | Path, profile: str | None = None) -> SweepConfig:
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise SweepConfigError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise SweepConfigError(f"{path}: a config is a JSON object")
    raw = strip_private_keys(raw)
    unknown = sorted(set(raw) - TOP_LEVEL_KEYS)
    if unknown:
        raise SweepConfigError(f"{path}: unknown top-level fields {unknown}")
    name, merged = select_profile(raw, profile, path)
    unknown = sorted(set(merged) - TOP_LEVEL_KEYS)
    if unknown:
        raise SweepConfigError(f"{path}: profile {name!r} has unknown fields {unknown}")
    for key in ("params", "sweep", "model", "roles", "paths", "run_card"):
        if merged.get(key) is not None and not isinstance(merged[key], dict):
            raise SweepConfigError(f"{path}: {key!r} must be an object, got {merged[key]!r}")
    threshold_json = merged.get("threshold_json")  # a literal file name: no placeholder substitution
    paths = resolve_paths(merged.get("paths") or {})
    merged = substitute({k: v for k, v in merged.items() if k != "threshold_json"}, paths)
    merged["paths"] = paths
    framework = str(merged.get("framework", "atom"))
    if framework not in ("atom", "atomc"):
        raise SweepConfigError(f"{path}: framework must be 'atom' (or 'atomc'), got {framework!r}")
    params = parse_params(merged.get("params") or {})
    _check_topology(params)
    notes: list[str] = []
    if merged.get("container"):
        notes.append("container is not used: atomc starts `atomc serve` as a local process, not in a container")
    server_args, server_env = _server_role(merged, params, notes)
    cells = build_cells(merged.get("sweep") or {}, params)
    notes += cells_past_max_len(cells, params)
    blocks = {k: merged[k] for k in BLOCK_KEYS if merged.get(k) is not None}
    for key, spec in blocks.items():
        if not isinstance(spec, dict):
            raise SweepConfigError(f"{path}: block {key!r} must be an object, got {spec!r}")
    return SweepConfig(
        path=path,
        model_id=(merged.get("model") or {}).get("id"),
        params=params,
        cells=cells,
        enforce_thresholds=bool(merged.get("enforce_thresholds", False)),
        threshold_json=threshold_json,
        server_args=server_args,
        server_env=server_env,
        profile=name,
        schema_version=int(str(raw.get("schema_version", 1))),
        framework=framework,
        gpu_arch=merged.get("gpu_arch") or _gpu_arch_from_name(path),
        run_card=merged.get("run_card") or {},
        blocks=blocks,
        notes=notes,
    )


def _gpu_arch_from_name(path: Path) -> str | None:
    """The page's `{gpu}_atom_...` file-name prefix, when the file follows it."""
    head, sep, _ = path.name.partition("_atom_")
    return head if sep and head else None


# --- threshold files --------------------------------------------------------------------------


def resolve_threshold_path(cfg: SweepConfig, explicit: str | Path | None) -> Path | None:
    """--threshold wins. Otherwise the page's rule: the threshold file lives next to the config
    (`threshold_json` names it; without it, the folder's one `*threshold.json` is used), and a
    folder holding several `*threshold.json` is ambiguous, even when `threshold_json` names one
    of them (CVS loads the folder's sole threshold file, so a lab's pair must sit alone)."""
    if explicit:
        path = Path(explicit)
    else:
        found = sorted(cfg.path.parent.glob("*threshold.json"))
        if len(found) > 1:
            raise SweepConfigError(
                f"ambiguous threshold files in {cfg.path.parent}: {', '.join(p.name for p in found)}; "
                "put each config and its threshold file in a folder of their own, or pass --threshold"
            )
        if cfg.threshold_json:
            path = cfg.sibling_threshold_path()
        else:
            path = found[0] if found else None
    if path is not None and not path.is_file():
        raise SweepConfigError(f"threshold file not found: {path}")
    return path


def load_thresholds(path: str | Path, profile: str) -> dict:
    """A threshold file's entries for `profile`: a file with `profiles` holds one set per profile
    (as shipped with schema_version 2 configs); a flat file applies to any profile."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise SweepConfigError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise SweepConfigError(f"{path}: a threshold file must be a JSON object keyed by cell")
    data = strip_private_keys(data)
    if "profiles" in data:
        profiles = data["profiles"]
        if not isinstance(profiles, dict) or profile not in profiles:
            names = ", ".join(sorted(profiles)) if isinstance(profiles, dict) else "none"
            raise SweepConfigError(f"{path}: no thresholds for profile {profile!r} (profiles: {names})")
        data = profiles[profile]
    return data
