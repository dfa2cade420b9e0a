"""The optional blocks of a CVS run (functional, accuracy, long-context, MTP quality, platform).

Each block is one module with `run(spec: dict, ctx: SuiteContext) -> BlockResult`: `spec` is the
block's part of the config, `ctx` says where the server under test is. A block never raises for a
failed check: it returns FAIL (the check ran and failed), SKIP (it could not apply, with the reason)
or ERROR (it could not run). The suite puts every result into the run's report JSON, which the run
deck renders.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

Verdict = Literal["PASS", "FAIL", "SKIP", "ERROR"]


@dataclass
class SuiteContext:
    base_url: str  # the server under test, e.g. http://127.0.0.1:8000
    model: str  # the name to send in requests
    out_dir: Path  # where the block may write files (inside the run's results folder)
    config_dir: Path  # the config file's folder: relative paths in a spec resolve here
    api_key: str | None = None
    params: dict = field(default_factory=dict)  # the config's `params`
    log: Callable[[str], None] = print
    # the whole threshold file: a block gates against its own top-level key (`accuracy`,
    # `long_context_accuracy`, `mtp_quality`), keyed by the task or cell id of its config
    # (last, so positional construction of the fields above keeps working)
    thresholds: dict = field(default_factory=dict)


@dataclass
class BlockResult:
    block: str  # e.g. "functional.api_smoke", "accuracy", "platform.gpu_metrics_poll"
    verdict: Verdict
    reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)  # named figures the gates read
    rows: list[dict] = field(default_factory=list)  # a table: one dict per task / cell / check
    samples: list[dict] = field(default_factory=list)  # time series (platform polls): {"t": s, ...}

    def to_dict(self) -> dict:
        return asdict(self)
