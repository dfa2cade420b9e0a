"""Run one lm-eval evaluation in its own process: `python -m atomc.bench.lm_eval_run REQUEST OUT`.

The accuracy block starts this as a subprocess rather than calling lm-eval in the suite's own
process: lm-eval seeds Python/NumPy/torch globally, configures logging, and imports torch and
`datasets`; a subprocess keeps all that away from the suite, and a hung evaluation can be killed
at `exec_timeout_sec`. It is not lm-eval's own CLI because that takes one `--include_path`, and
a run needs two (atomc's shipped tasks and the user's own).

REQUEST is JSON: {"model", "model_args", "tasks", "include_path": [...], "evaluate": {kwargs of
`lm_eval.simple_evaluate`}}. OUT gets {"results", "n-samples", "versions", "samples": {task:
[first few scored samples]}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SAMPLES_KEPT = 40  # rows per task (a row per doc and filter): enough to see what the model answered


def _sample_row(sample: dict) -> dict:
    doc = sample.get("doc") or {}
    return {
        "doc_id": sample.get("doc_id"),
        "filter": sample.get("filter"),  # one row per doc and filter (strict-match, flexible-extract)
        "prompt": doc.get("question", doc) if isinstance(doc, dict) else doc,
        "target": sample.get("target"),
        "response": sample.get("filtered_resps"),
        "metrics": {k: sample[k] for k in sample.get("metrics", []) if k in sample},
    }


def main(request_path: str, out_path: str) -> int:
    import lm_eval
    from lm_eval.tasks import TaskManager

    req = json.loads(Path(request_path).read_text())
    metadata = req.get("metadata") or None
    # indexing lm-eval's own ~15k task files takes tens of seconds: skip it when the include
    # paths (atomc's tasks, the user's) have every task asked for
    manager = TaskManager(include_path=req["include_path"], include_defaults=False, metadata=metadata)
    if any(t not in manager.all_tasks for t in req["tasks"]):
        manager = TaskManager(include_path=req["include_path"], metadata=metadata)
    unknown = [t for t in req["tasks"] if t not in manager.all_tasks]
    if unknown:
        print(
            f"unknown lm-eval task(s) {unknown}: not shipped by lm-eval or atomc, nor found under "
            f"include_path {req['include_path']}",
            file=sys.stderr,
        )
        return 3
    out = lm_eval.simple_evaluate(
        model=req["model"],
        model_args=req["model_args"],
        tasks=req["tasks"],
        task_manager=manager,
        log_samples=True,
        **req.get("evaluate", {}),
    )
    if out is None:
        print("lm-eval returned no results", file=sys.stderr)
        return 4
    samples = {task: [_sample_row(s) for s in rows[:SAMPLES_KEPT]] for task, rows in (out.get("samples") or {}).items()}
    result = {k: out.get(k) for k in ("results", "n-samples", "versions")}
    result["samples"] = samples
    Path(out_path).write_text(json.dumps(result, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
