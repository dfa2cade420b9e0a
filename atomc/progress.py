"""Progress bars for the long start-up phases (compiling, loading weight files, capturing CUDA
graphs), shown only on a terminal: a log file or a pipe gets each phase's one line with its time
instead of a bar's redraws."""

from __future__ import annotations

import sys


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, unit: str, enabled: bool | None = None):
    """A tqdm bar on stderr when it is a terminal (or `enabled`), else one that draws nothing."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled or total < 2:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)
