"""The environment a benchmark's engine process runs in: this source tree's atomc first on PYTHONPATH.

A benchmark run from another tree (an A/B against an older commit unpacked into `.prev/`) must
measure that tree's engine, whatever PYTHONPATH the caller exported; otherwise both arms of the A/B
import the same atomc (what happened once, docs/performance.md section 11).
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child_env(**extra: str) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), path) if p), **extra}
