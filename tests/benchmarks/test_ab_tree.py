"""benchmarks/ab_tree.py: the committed tree copied with switches set, and clear errors."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import ab_tree  # noqa: E402

pytestmark = pytest.mark.skipif(not (ROOT / ".git").exists(), reason="ab_tree copies a git checkout's HEAD")


def test_a_copy_with_a_switch_on_imports_it(tmp_path):
    out = tmp_path / "on"
    lines = ab_tree.write_tree(out, ["atomc.kernels.triton.head_matmul.ONE_ROW=False"])
    assert lines == ["ONE_ROW = False"]  # HEAD has it on
    # the module, not the package's function of the same name
    code = (
        "import importlib; m = importlib.import_module('atomc.kernels.triton.head_matmul'); "
        "print(m.ONE_ROW, m.__file__)"
    )
    got = subprocess.run([sys.executable, "-c", code], cwd=out, capture_output=True, text=True, check=True)
    flag, path = got.stdout.split()
    assert flag == "False" and Path(path).resolve().is_relative_to(out.resolve())
    assert (out / "benchmarks" / "decode_bs1.py").is_file() and not (out / ".git").exists()


def test_bad_switches_are_named(tmp_path):
    with pytest.raises(SystemExit, match="not module.NAME=value"):
        ab_tree.write_tree(tmp_path / "a", ["ONE_ROW"])
    with pytest.raises(SystemExit, match="no module atomc.nowhere"):
        ab_tree.write_tree(tmp_path / "b", ["atomc.nowhere.X=1"])
    with pytest.raises(SystemExit, match="0 top-level assignments to NOT_A_SWITCH"):
        ab_tree.write_tree(tmp_path / "c", ["atomc.kernels.triton.head_matmul.NOT_A_SWITCH=1"])
