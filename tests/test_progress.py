"""Progress bars draw only on a terminal: a log file gets phase lines, not redraws."""

from __future__ import annotations

import io
import sys

from atomc.progress import progress_bar


def test_no_bar_off_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    bar = progress_bar(10, "graphs", "graph")
    bar.update(3)
    bar.close()
    assert sys.stderr.getvalue() == ""


def test_a_bar_when_asked(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    bar = progress_bar(4, "weights", "file", enabled=True)
    for _ in range(4):
        bar.update(1)
    bar.close()
    assert "weights" in sys.stderr.getvalue()


def test_one_step_needs_no_bar(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    progress_bar(1, "weights", "file", enabled=True).close()
    assert sys.stderr.getvalue() == ""
