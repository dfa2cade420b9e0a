"""A phase-by-phase progress bar for a build (one tick per phase; a phase can take minutes)."""

from __future__ import annotations

from atomc.progress import progress_bar


class Phases:
    def __init__(self, names: list[str], enabled: bool | None = None):
        """`enabled`: None = when stderr is a terminal."""
        self.names = names
        self.bar = progress_bar(len(names), "compile", "phase", enabled)
        self.bar.set_postfix_str(names[0])

    def done(self, name: str) -> None:
        if name not in self.names:
            return
        self.bar.update(1)
        i = self.names.index(name)
        if i + 1 < len(self.names):
            self.bar.set_postfix_str(self.names[i + 1])

    def close(self) -> None:
        self.bar.close()
