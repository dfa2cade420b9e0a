"""A phase-by-phase progress bar for `atomc compile` (one tick per phase; a phase can take minutes)."""

from __future__ import annotations

import sys


class Phases:
    def __init__(self, names: list[str], enabled: bool = True):
        self.names = names
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=len(names), desc="compile", unit="phase", file=sys.stderr, leave=False)
            self.bar.set_postfix_str(names[0])

    def done(self, name: str) -> None:
        if self.bar is None or name not in self.names:
            return
        self.bar.update(1)
        i = self.names.index(name)
        if i + 1 < len(self.names):
            self.bar.set_postfix_str(self.names[i + 1])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
