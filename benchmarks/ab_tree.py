"""A copy of this tree's committed sources with module switches set: the other arm of an A/B.

atomc keeps an untimed hot-path change behind a module constant, off (`ONE_ROW = False` in
atomc/kernels/triton/head_matmul.py, ...). To time it, a device call runs the same benchmark from
the committed tree and from a copy with the switch on; each engine child imports its own tree's
atomc (tree_env.py). This writes that copy: `git archive HEAD` of the source folders, then each
`module.NAME=value` rewritten on the module's one top-level `NAME = ...` line (an error when the
module has none, or several).

    python benchmarks/ab_tree.py .whl/on atomc.kernels.triton.head_matmul.ONE_ROW=True
    (cd .whl/on && PYTHONPATH=$PWD python benchmarks/decode_bs1_moe.py --model deepseek-v2-lite ...)
"""

from __future__ import annotations

import argparse
import io
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("atomc", "models", "benchmarks", "tests", "pyproject.toml")


def set_switch(tree: Path, assignment: str) -> str:
    """Rewrite `module.NAME=value` in `tree`; returns the new line."""
    target, sep, value = assignment.partition("=")
    module, _, name = target.rpartition(".")
    if not sep or not module or not name.isidentifier() or not value.strip():
        raise SystemExit(f"ab_tree: {assignment!r} is not module.NAME=value")
    path = tree / (module.replace(".", "/") + ".py")
    if not path.is_file():
        raise SystemExit(f"ab_tree: no module {module} ({path.relative_to(tree)})")
    text = path.read_text()
    pattern = re.compile(rf"^{re.escape(name)}(\s*:[^=]+)?\s*=.*$", re.MULTILINE)
    hits = pattern.findall(text)
    if len(hits) != 1:
        raise SystemExit(f"ab_tree: {module} has {len(hits)} top-level assignments to {name}, not one")
    line = f"{name}{hits[0]} = {value.strip()}"
    path.write_text(pattern.sub(lambda _: line, text))
    return line


def write_tree(out: Path, assignments: list[str], ref: str = "HEAD") -> list[str]:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", ref, *FOLDERS], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(out, filter="data")
    return [set_switch(out, a) for a in assignments]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the folder to write (replaced if it exists)")
    ap.add_argument("switches", nargs="*", help="module.NAME=value, e.g. atomc.kernels.triton.moe.PACKED_GEMV=False")
    ap.add_argument("--ref", default="HEAD", help="the commit to copy")
    args = ap.parse_args()
    for line in write_tree(args.out, args.switches, args.ref):
        print(f"{args.out}: {line}")


if __name__ == "__main__":
    main()
