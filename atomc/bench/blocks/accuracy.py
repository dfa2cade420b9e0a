"""The `accuracy` block: lm-eval tasks against the server under test, gated per task.

Config (the CVS `accuracy.tasks[]` schema; lm-eval 0.4 names):
  {"tasks": [{"id": "arith", "task": "atomc_arith", "num_fewshot": 5, "limit": 50, ...}]}
Each task runs `lm_eval.simple_evaluate` with lm-eval's `local-completions` model (or
`local-chat-completions` when `apply_chat_template` is set, or as `lm_eval_model` says) pointed at
`ctx.base_url`, in a subprocess (lm_eval_run.py says why). Every numeric result becomes a metric
named as CVS projects lm-eval's results: `{lm_task}.{metric}__{filter}`, e.g.
`atomc_arith.exact_match__flexible-extract`.

Thresholds come from the threshold file's top-level `accuracy` key, by task id:
  "accuracy": {"arith": {"atomc_arith.exact_match__flexible-extract": {"kind": "min", "value": 0.9}}}
judged by the sweep's own rule (thresholds.evaluate). A task with no entry, or `{}`, is recorded
only. A gated metric the task did not produce FAILs, naming the ones it did: lm-eval's metric
set is fixed by the task, so a missing one is a typo, not a missing measurement.

Offline task data: `atomc_arith` (GSM8K-style problems, arith.py) and `atomc_agreement` (minimal
pairs scored by log-likelihood, agreement.py) ship in lm_eval_tasks/, which
is always on the include path; any task the user has locally is usable by name, lm-eval's own
(whose data must then be in the local `datasets` cache) or one under the task's `include_path`.

The client sends text, not token ids (`tokenized_requests=False`, no tokenizer): generation
tasks then need nothing but the server. Log-likelihood tasks need a tokenizer: set `tokenizer`
(a local Hugging Face folder), and the server must score prompts (`echo` with `logprobs`).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from atomc.bench.blocks import BlockResult, SuiteContext
from atomc.bench.thresholds import Status, Verdict, describe_threshold, evaluate

BLOCK = "accuracy"
SHIPPED_TASKS = Path(__file__).resolve().parent.parent / "lm_eval_tasks"
MODELS = ("local-completions", "local-chat-completions")
# the CVS AccuracyTask fields; `backend` and `device` are accepted and unused (API models run on
# the server, not here), `tokenizer` is atomc's
FIELDS = {
    "id",
    "task",
    "tasks",
    "backend",
    "lm_eval_model",
    "extra_model_args",
    "num_concurrent",
    "num_fewshot",
    "batch_size",
    "max_batch_size",
    "device",
    "gen_kwargs",
    "limit",
    "samples",
    "use_cache",
    "cache_requests",
    "check_integrity",
    "system_instruction",
    "apply_chat_template",
    "fewshot_as_multiturn",
    "include_path",
    "predict_only",
    "seed",
    "trust_remote_code",
    "confirm_run_unsafe_code",
    "metadata",
    "exec_timeout_sec",
    "tokenizer",
    "max_retries",
    "timeout",
}
DEFAULT_TIMEOUT_S = 4 * 60 * 60  # CVS's exec_timeout_sec


class AccuracySpecError(ValueError):
    pass


# --- the spec ----------------------------------------------------------------------------------


def task_names(task: dict) -> list[str]:
    """`tasks` (a list or a comma-separated string) or the legacy `task`; they must agree."""

    def split(v) -> list[str]:
        if isinstance(v, list):
            return [str(x).strip() for x in v if str(x).strip()]
        return [x.strip() for x in str(v).split(",") if x.strip()]

    tasks, legacy = task.get("tasks"), task.get("task")
    if tasks is None and legacy is None:
        raise AccuracySpecError(f"accuracy task {task.get('id')!r}: set `task` or `tasks`")
    names = split(tasks if tasks is not None else legacy)
    if tasks is not None and legacy is not None and split(legacy) != names:
        raise AccuracySpecError(f"accuracy task {task.get('id')!r}: `task` and `tasks` disagree")
    if not names:
        raise AccuracySpecError(f"accuracy task {task.get('id')!r}: no task name")
    return names


def validate_tasks(spec: dict) -> list[dict]:
    if not isinstance(spec, dict) or not isinstance(spec.get("tasks"), list):
        raise AccuracySpecError("accuracy needs `tasks`: a list of {id, task, ...}")
    tasks = spec["tasks"]
    ids = []
    for i, task in enumerate(tasks):
        if not isinstance(task, dict) or not isinstance(task.get("id"), str):
            raise AccuracySpecError(f"accuracy.tasks[{i}] needs a string `id`")
        unknown = sorted(k for k in task if k not in FIELDS and not k.startswith("_"))
        if unknown:
            raise AccuracySpecError(f"accuracy task {task['id']!r}: unknown field(s) {unknown}")
        model = task.get("lm_eval_model")
        if model is not None and model not in MODELS:
            raise AccuracySpecError(f"accuracy task {task['id']!r}: lm_eval_model must be one of {MODELS}")
        seed = task.get("seed")
        if seed is not None and (not isinstance(seed, list) or len(seed) != 4):
            raise AccuracySpecError(f"accuracy task {task['id']!r}: seed is [python, numpy, torch, fewshot]")
        task_names(task)
        ids.append(task["id"])
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise AccuracySpecError(f"duplicate accuracy task id(s): {', '.join(map(repr, dupes))}")
    return tasks


def parse_model_args(value: str) -> dict[str, str]:
    """`key=value,key=value` (lm-eval's model_args form), as CVS's `extra_model_args`."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in (value or "").split(","))):
        key, sep, arg = part.partition("=")
        if not sep or not key:
            raise AccuracySpecError(f"extra_model_args entries must be key=value, got {part!r}")
        out[key.strip()] = arg
    return out


def lm_eval_model(task: dict) -> str:
    if task.get("lm_eval_model"):
        return task["lm_eval_model"]
    return "local-chat-completions" if task.get("apply_chat_template") else "local-completions"


def resolve_path(value: str, ctx: SuiteContext) -> str:
    path = Path(os.path.expanduser(value))
    return str(path if path.is_absolute() else ctx.config_dir / path)


def build_request(task: dict, ctx: SuiteContext) -> dict:
    """The lm_eval_run request for one task: model, model args, tasks, include paths, options."""
    model = lm_eval_model(task)
    endpoint = "/v1/chat/completions" if model == "local-chat-completions" else "/v1/completions"
    args: dict = {
        "base_url": ctx.base_url.rstrip("/") + endpoint,
        "model": ctx.model,
        "num_concurrent": int(task.get("num_concurrent", 8)),
        "max_retries": int(task.get("max_retries", 3)),
        "timeout": int(task.get("timeout", 600)),
        "tokenized_requests": False,
        "tokenizer_backend": None,
    }
    if task.get("tokenizer"):
        args.update(tokenizer=resolve_path(task["tokenizer"], ctx), tokenizer_backend="huggingface")
    extras = parse_model_args(task.get("extra_model_args", ""))
    owned = sorted({"base_url", "model"} & set(extras))
    if owned:
        raise AccuracySpecError(f"accuracy task {task['id']!r}: extra_model_args cannot set {owned} (the suite does)")
    args.update(extras)
    if ctx.api_key:
        args["auth_token"] = ctx.api_key
    include = [str(SHIPPED_TASKS)]
    if task.get("include_path"):
        paths = task["include_path"] if isinstance(task["include_path"], list) else [task["include_path"]]
        include += [resolve_path(p, ctx) for p in paths]
    seed = task.get("seed") or [0, 1234, 1234, 1234]
    evaluate_kwargs = {
        "num_fewshot": task.get("num_fewshot"),
        "batch_size": task.get("batch_size", 1),
        "max_batch_size": task.get("max_batch_size"),
        "gen_kwargs": task.get("gen_kwargs") or None,
        "limit": task.get("limit"),
        "samples": task.get("samples"),
        "use_cache": task.get("use_cache"),
        "cache_requests": task.get("cache_requests") in ("true", "refresh", True),
        "rewrite_requests_cache": task.get("cache_requests") == "refresh",
        "delete_requests_cache": task.get("cache_requests") == "delete",
        "check_integrity": bool(task.get("check_integrity", False)),
        "system_instruction": task.get("system_instruction"),
        "apply_chat_template": task.get("apply_chat_template", False),
        "predict_only": bool(task.get("predict_only", False)),
        "random_seed": seed[0],
        "numpy_random_seed": seed[1],
        "torch_random_seed": seed[2],
        "fewshot_random_seed": seed[3],
        "confirm_run_unsafe_code": bool(task.get("confirm_run_unsafe_code", False)),
    }
    if task.get("fewshot_as_multiturn") is not None:
        evaluate_kwargs["fewshot_as_multiturn"] = bool(task["fewshot_as_multiturn"])
    if task.get("trust_remote_code"):
        args["trust_remote_code"] = True
    return {
        "model": model,
        "model_args": args,
        "tasks": task_names(task),
        "include_path": include,
        "metadata": task.get("metadata") or None,
        "evaluate": evaluate_kwargs,
    }


# --- results and gates -------------------------------------------------------------------------


def _real(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and not math.isnan(x)


def project(results: dict) -> dict[str, float]:
    """lm-eval's `results` as flat metrics, named as CVS does: `{task}.{metric}__{filter}`."""
    out = {}
    for lm_task, metrics in (results or {}).items():
        for key, value in metrics.items():
            if key != "alias" and _real(value):
                out[f"{lm_task}.{key}".replace(",", "__")] = float(value)
    return out


def gate_task(task_id: str, metrics: dict[str, float], specs) -> list[dict]:
    """One row per gated metric of a task; a task without specs gets one INFO row."""
    if not isinstance(specs, dict) or not any(not k.startswith("_") for k in specs):
        return [
            {
                "task": task_id,
                "metric": "-",
                "threshold": "-",
                "actual": None,
                "status": str(Status.INFO),
                "reason": "no thresholds for task: recorded only",
            }
        ]
    rows = []
    for metric, spec in specs.items():
        if metric.startswith("_"):
            continue
        if metric not in metrics and metrics:
            produced = ", ".join(sorted(metrics))
            verdict = Verdict(Status.FAIL, f"the task produced no {metric!r}; it produced: {produced}")
        else:
            verdict = evaluate(spec, metrics.get(metric), metrics)
        rows.append(
            {
                "task": task_id,
                "metric": metric,
                "threshold": describe_threshold(spec),
                "actual": metrics.get(metric),
                "status": str(verdict.status),
                "reason": verdict.reason,
            }
        )
    return rows


def worst(statuses) -> str:
    seen = set(statuses)
    present = [s for s in ("ERROR", "FAIL", "PASS", "SKIP", "INFO") if s in seen]
    return present[0] if present else "INFO"


def block_verdict(rows: list[dict]) -> tuple[str, str]:
    """ERROR if a task could not run, else FAIL if a gate failed, else PASS."""
    errors = [f"{r['id']}: {r['error']}" for r in rows if r.get("error")]
    if errors:
        return "ERROR", "; ".join(errors)
    failed = [(r["id"], g) for r in rows for g in r["gates"] if g["status"] == "FAIL"]
    if failed:
        return "FAIL", "; ".join(f"{tid}: {g['metric']} {g['reason']}" for tid, g in failed)
    gated = sum(g["status"] == "PASS" for r in rows for g in r["gates"])
    return "PASS", f"{len(rows)} task(s), {gated} gate(s) passed"


def run_lm_eval(request: dict, work_dir: Path, timeout_s: float, log) -> dict:
    """Run lm_eval_run.py on `request`; its output dict, or RuntimeError with the log's tail."""
    work_dir.mkdir(parents=True, exist_ok=True)
    req_path, out_path = work_dir / "request.json", work_dir / "lm_eval_results.json"
    log_path = work_dir / "lm_eval.log"
    req_path.write_text(json.dumps(request, indent=1) + "\n")
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": os.environ.get("HF_DATASETS_OFFLINE", "1"),
        "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [sys.executable, "-m", "atomc.bench.lm_eval_run", str(req_path), str(out_path)]
    log(f"accuracy: lm-eval {','.join(request['tasks'])} against {request['model_args']['base_url']} (log: {log_path})")
    with open(log_path, "wb") as log_file:
        try:
            proc = subprocess.run(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            msg = f"lm-eval did not finish in {timeout_s:.0f}s (exec_timeout_sec); log: {log_path}"
            raise RuntimeError(msg) from None
    if proc.returncode != 0 or not out_path.is_file():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"lm-eval exited with code {proc.returncode}; log {log_path}:\n{tail}")
    return json.loads(out_path.read_text())


def lm_eval_available() -> str | None:
    """None when lm-eval and its API-client dependencies import, else why not."""
    import importlib.util

    missing = [m for m in ("lm_eval", "aiohttp", "tenacity", "requests") if importlib.util.find_spec(m) is None]
    if missing:
        return f"lm-eval is not installed (missing {', '.join(missing)}): pip install 'atomc[bench]'"
    return None


def run(spec: dict, ctx: SuiteContext) -> BlockResult:
    try:
        tasks = validate_tasks(spec)
        requests = {t["id"]: build_request(t, ctx) for t in tasks}
    except AccuracySpecError as exc:
        return BlockResult(BLOCK, "ERROR", f"config error: {exc}")
    if not tasks:
        return BlockResult(BLOCK, "SKIP", "accuracy.tasks is empty")
    why_not = lm_eval_available()
    if why_not:
        return BlockResult(BLOCK, "ERROR", why_not)
    thresholds = (ctx.thresholds or {}).get("accuracy") or {}
    metrics: dict[str, float] = {}
    rows: list[dict] = []
    for task in tasks:
        task_id, request = task["id"], requests[task["id"]]
        row = {"id": task_id, "tasks": request["tasks"], "model": request["model"], "metrics": {}, "gates": []}
        t0 = time.monotonic()
        try:
            out = run_lm_eval(
                request,
                ctx.out_dir / "accuracy" / task_id,
                float(task.get("exec_timeout_sec", DEFAULT_TIMEOUT_S)),
                ctx.log,
            )
        except RuntimeError as exc:
            row.update(status="ERROR", error=str(exc), duration_s=round(time.monotonic() - t0, 2))
            rows.append(row)
            continue
        task_metrics = project(out.get("results") or {})
        # block metrics carry the task id: two tasks may run one lm-eval task (CVS's gsm8k_flex and
        # gsm8k_strict), and their figures must not overwrite each other
        metrics.update({f"{task_id}/{k}": v for k, v in task_metrics.items()})
        row.update(
            metrics=task_metrics,
            gates=gate_task(task_id, task_metrics, thresholds.get(task_id)),
            n_samples=out.get("n-samples"),
            duration_s=round(time.monotonic() - t0, 2),
        )
        row["status"] = worst(g["status"] for g in row["gates"])
        (ctx.out_dir / "accuracy" / task_id / "samples.json").write_text(
            json.dumps(out.get("samples") or {}, indent=1, default=str) + "\n"
        )
        rows.append(row)
    verdict, reason = block_verdict(rows)
    return BlockResult(BLOCK, verdict, reason, metrics=metrics, rows=rows)
