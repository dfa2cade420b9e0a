"""A benchmark's engine child imports the atomc of the tree the script lives in, before any
PYTHONPATH the caller exported (an A/B of two trees must not measure one of them twice)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from tree_env import child_env  # noqa: E402


def test_the_child_imports_this_trees_atomc(tmp_path, monkeypatch):
    decoy = tmp_path / "other" / "atomc"  # another tree's atomc, first on the caller's PYTHONPATH
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "other"))
    cwd = tmp_path / "cwd"  # not this tree: `python -c` puts its working folder first on sys.path
    cwd.mkdir()
    code = "import atomc, pathlib; print(pathlib.Path(atomc.__file__).resolve().parent.parent)"
    out = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), cwd=cwd, capture_output=True, text=True, check=True
    )
    assert Path(out.stdout.strip()) == ROOT
    plain = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=True)
    assert Path(plain.stdout.strip()) == tmp_path / "other"  # what the child would have imported
    assert child_env(X="1")["X"] == "1"
