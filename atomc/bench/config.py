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
Threshold coverage (`enforce_thresholds`) is checked in `thresholds.py`, once the threshold file
is known (`--threshold` may replace it).
"""

from __future__ import annotations

import copy
import json
import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from atomc import env


class SweepConfigError(ValueError):
    pass


DEFAULT_PROFILE = "perf"
NATIVE_DRIVERS = ("atom", "atomc")  # the server is `atomc serve`, started by the suite
EXTERNAL_DRIVERS = ("vllm_atom", "sglang", "vllm")  # a server the user starts; reached through --base-url
TOP_LEVEL_KEYS = {
    "schema_version", "framework", "gpu_arch", "default_profile", "profiles", "enforce_thresholds",
    "threshold_json", "paths", "model", "container", "roles", "params", "sweep", "run_card",
    "functional", "platform", "accuracy", "long_context_accuracy", "mtp_quality", "quant_parity",
}  # fmt: skip
# the optional blocks the suite knows; blocks/registry.py maps each to the module that runs it
BLOCK_KEYS = ("functional", "platform", "accuracy", "long_context_accuracy", "mtp_quality", "quant_parity")
PLACEHOLDER = re.compile(r"\{(user-id|shared_fs|paths\.[A-Za-z0-9_]+)\}")


# --- reading the file -------------------------------------------------------------------------


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


# --- params -----------------------------------------------------------------------------------


def _int(value, name: str, minimum: int = 0) -> int:
    try:
        n = int(str(value).strip())
    except (TypeError, ValueError):
        raise SweepConfigError(f"params.{name} must be an integer, got {value!r}") from None
    if n < minimum:
        raise SweepConfigError(f"params.{name} must be >= {minimum}, got {n}")
    return n


def _float(value, name: str, minimum: float = 0.0) -> float:
    try:
        x = float(str(value).strip())
    except (TypeError, ValueError):
        raise SweepConfigError(f"params.{name} must be a number, got {value!r}") from None
    if math.isnan(x) or x < minimum:
        raise SweepConfigError(f"params.{name} must be >= {minimum:g}, got {value!r}")
    return x


def _bool(value, name: str) -> bool:
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no", ""):
        return False
    raise SweepConfigError(f"params.{name} must be true or false, got {value!r}")


def _only(allowed: tuple[str, ...], why: str):
    def check(value, name: str) -> str:
        text = str(value).strip()
        if text not in allowed:
            raise SweepConfigError(f"params.{name}={value!r} is not supported: {why}")
        return text

    return check


def _percentile_metrics(value, name: str) -> str:
    families = {v.strip() for v in str(value).split(",") if v.strip()}
    unknown = families - {"ttft", "tpot", "itl", "e2el"}
    if unknown:
        raise SweepConfigError(
            f"params.{name}: unknown metric families {sorted(unknown)} (known: ttft, tpot, itl, e2el)"
        )
    return str(value)


def _metric_percentiles(value, name: str) -> str:
    for part in str(value).split(","):
        if part.strip():
            p = _float(part, name)
            if not 0 < p < 100:
                raise SweepConfigError(f"params.{name}: percentiles lie in (0, 100), got {part.strip()}")
    return str(value)


def _empty(why: str):
    def check(value, name: str) -> str:
        if str(value).strip():
            raise SweepConfigError(f"params.{name}={value!r} is not supported: {why}")
        return ""

    return check


def _exactly(expected: float, why: str):
    def check(value, name: str) -> float:
        x = _float(value, name)
        if x != expected:
            raise SweepConfigError(f"params.{name}={value!r} is not supported: {why}")
        return x

    return check


# name -> (parse(value, name) -> value, default). What each one does is in docs/benchmarking.md.
PARAMS = {
    "driver": (
        _only(NATIVE_DRIVERS + EXTERNAL_DRIVERS, "drivers are atom (atomc serve), vllm_atom, sglang, vllm"),
        "atom",
    ),
    "backend": (
        _only(("vllm", "openai"), "atomc bench speaks the OpenAI completions API (backend vllm/openai)"),
        "vllm",
    ),
    "base_url": (lambda v, n: str(v).strip(), ""),
    "port_no": (lambda v, n: _int(v, n, 1), None),
    "dataset_name": (_only(("random",), "atomc bench only draws random token-id prompts"), "random"),
    "burstiness": (_exactly(1.0, "arrivals are Poisson (burstiness 1.0) only"), 1.0),
    "seed": (lambda v, n: _int(v, n), 0),
    "request_rate": (lambda v, n: _rate(v, n), math.inf),
    "random_range_ratio": (lambda v, n: _float(v, n), 0.0),
    "random_prefix_len": (_exactly(0.0, "prompts share no fixed prefix in atomc bench"), 0),
    "tensor_parallelism": (lambda v, n: _int(v, n, 1), 1),
    "pipeline_parallel_size": (lambda v, n: _int(v, n, 1), 1),
    "nnodes": (lambda v, n: _int(v, n, 1), 1),
    "master_addr": (lambda v, n: str(v).strip(), ""),
    "master_port": (lambda v, n: _int(v, n, 1), 29501),
    "tokenizer_mode": (_only(("auto",), "prompts are token ids; no tokenizer is used"), "auto"),
    "percentile_metrics": (_percentile_metrics, "ttft,tpot,itl,e2el"),
    "metric_percentiles": (_metric_percentiles, ""),
    "num_prompts": (lambda v, n: _int(v, n, 1), None),
    "max_model_length": (lambda v, n: _int(v, n, 1), None),
    "num_warmups": (lambda v, n: _int(v, n), 0),
    "client_initial_wait_s": (lambda v, n: _float(v, n), 120.0),
    "client_poll_count": (lambda v, n: _int(v, n, 1), 50),
    "client_poll_wait_time": (lambda v, n: _float(v, n), 60.0),
    "server_precheck_wait_s": (lambda v, n: _float(v, n), 30.0),
    "server_warmup_wait_s": (lambda v, n: _float(v, n), 330.0),
    "server_poll_count": (lambda v, n: _int(v, n, 1), 60),
    "server_poll_wait_time": (lambda v, n: _float(v, n), 60.0),
    "server_ready_timeout_s": (lambda v, n: _float(v, n), None),
    "reuse_server_across_sweep": (_bool, None),
    "bench_max_failed_requests": (lambda v, n: _int(v, n), None),
    "bench_extra_args": (_empty("atomc bench takes no extra client flags; use the params fields"), ""),
    "result_filename": (lambda v, n: _safe_name(v, n), "results"),
    "scaling_baseline_output_throughput": (lambda v, n: _float(v, n) if str(v).strip() else None, None),
}


def _rate(value, name: str) -> float:
    x = _float(value, name)
    if x == 0:
        raise SweepConfigError(f"params.{name} must be > 0 requests/s or inf, got {value!r}")
    return x


def _safe_name(value, name: str) -> str:
    text = str(value).strip()
    if not re.fullmatch(r"[A-Za-z0-9._-]+", text):
        raise SweepConfigError(f"params.{name} must be a plain file name, got {value!r}")
    return text


def parse_params(raw: dict) -> dict:
    unknown = sorted(set(raw) - set(PARAMS))
    if unknown:
        raise SweepConfigError(f"unknown params {unknown}; known: {', '.join(sorted(PARAMS))}")
    out = {}
    for name, (parse, default) in PARAMS.items():
        value = raw.get(name)
        out[name] = default if value is None else parse(value, name)
    return out


def server_ready_timeout_s(params: dict) -> float:
    """How long a server may take to answer /health: CVS's precheck + warm-up waits plus its poll
    budget (count x wait); `server_ready_timeout_s` (atomc's own) replaces the sum when set."""
    if params["server_ready_timeout_s"] is not None:
        return params["server_ready_timeout_s"]
    return (
        params["server_precheck_wait_s"]
        + params["server_warmup_wait_s"]
        + params["server_poll_count"] * params["server_poll_wait_time"]
    )


def client_timeout_s(params: dict) -> float:
    """How long one cell's client run may take before it is cut off (CVS: initial wait + polls)."""
    return params["client_initial_wait_s"] + params["client_poll_count"] * params["client_poll_wait_time"]


# --- cells ------------------------------------------------------------------------------------


def cell_key(isl: int, osl: int, tp: int, pp: int, concurrency: int) -> str:
    """The threshold key of a cell, as the page builds it (PP= always present; nnodes is not in it)."""
    return f"ISL={isl},OSL={osl},TP={tp},PP={pp},CONC={concurrency}"


@dataclass(frozen=True)
class SweepCell:
    combo: str
    isl: int
    osl: int
    tp: int
    pp: int
    concurrency: int
    num_prompts: int

    @property
    def key(self) -> str:
        return cell_key(self.isl, self.osl, self.tp, self.pp, self.concurrency)


def _positive_int(value, what: str) -> int:
    try:
        n = int(value)  # CVS writes isl/osl as strings
    except (TypeError, ValueError):
        raise SweepConfigError(f"{what} must be an integer, got {value!r}") from None
    if n <= 0:
        raise SweepConfigError(f"{what} must be positive, got {n}")
    return n


def build_cells(sweep: dict, params: dict) -> list[SweepCell]:
    combos = {}
    for combo in sweep.get("sequence_combinations") or []:
        name = combo.get("name")
        if not name or name in combos:
            raise SweepConfigError(f"sequence_combinations needs unique names, got {name!r}")
        combos[name] = combo
    cells: list[SweepCell] = []
    for i, run in enumerate(sweep.get("runs") or []):
        combo = combos.get(run.get("combo"))
        if combo is None:
            raise SweepConfigError(
                f"sweep.runs[{i}] names unknown combo {run.get('combo')!r} (known: {', '.join(combos) or 'none'})"
            )
        prompts = run.get("num_prompts", params.get("num_prompts"))
        if prompts is None:
            raise SweepConfigError(f"sweep.runs[{i}]: set params.num_prompts or the run's num_prompts")
        cells.append(
            SweepCell(
                combo=combo["name"],
                isl=_positive_int(combo.get("isl"), f"combo {combo['name']!r} isl"),
                osl=_positive_int(combo.get("osl"), f"combo {combo['name']!r} osl"),
                tp=params["tensor_parallelism"],
                pp=params["pipeline_parallel_size"],
                concurrency=_positive_int(run.get("concurrency"), f"sweep.runs[{i}].concurrency"),
                num_prompts=_positive_int(prompts, f"sweep.runs[{i}].num_prompts"),
            )
        )
    if not cells:
        raise SweepConfigError("sweep.runs is empty: nothing to run")
    keys = [c.key for c in cells]
    if len(set(keys)) != len(keys):
        raise SweepConfigError(f"two runs share a cell key; results would collide: {keys}")
    return cells


def cells_past_max_len(cells: list[SweepCell], params: dict) -> list[str]:
    """Notes for cells whose longest request (range ratio included) exceeds `max_model_length`:
    the server refuses those requests, which then count as failed. A note, not an error: shipped
    lab files have such cells (an 8k prompt with ratio 0.8 against a 10k context)."""
    limit = params["max_model_length"]
    if limit is None:
        return []
    r = params["random_range_ratio"]
    notes = []
    for c in cells:
        longest = math.ceil(c.isl * (1 + r)) + math.ceil(c.osl * (1 + r))
        if longest > limit:
            notes.append(
                f"cell {c.key}: its longest request ({longest} tokens with random_range_ratio {r:g}) exceeds "
                f"params.max_model_length {limit}; the server will refuse such requests (counted as failed)"
            )
    return notes


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
