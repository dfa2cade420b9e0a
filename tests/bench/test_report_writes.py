"""The suite's report.json and cell files are written whole or not at all: a run stopped in the middle
of a write (the CVS script's suite timeout sends SIGTERM) leaves the last complete file, from which
the script renders the deck."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from atomc.bench import suite


def test_a_write_stopped_midway_leaves_the_last_whole_file(tmp_path, monkeypatch):
    path = tmp_path / "report.json"
    suite.write_json(path, {"cells": {"a": 1.0}, "rate": float("inf")})
    assert json.loads(path.read_text()) == {"cells": {"a": 1.0}, "rate": "inf"}

    real = Path.write_text

    def stopped(self, text, *args, **kwargs):  # half the text, then the signal
        real(self, text[: len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", stopped)
    with pytest.raises(KeyboardInterrupt):
        suite.write_json(path, {"cells": {"a": 1.0, "b": 2.0}})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"cells": {"a": 1.0}, "rate": "inf"}  # the last whole report
    suite.write_json(path, {"cells": {"a": 1.0, "b": 2.0}})  # the next write replaces it, leftovers and all
    assert json.loads(path.read_text()) == {"cells": {"a": 1.0, "b": 2.0}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
