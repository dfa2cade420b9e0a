"""Which project files a compile depends on, found before tracing: the cache key hashes only these.

A lookup happens before Dynamo runs (a hit skips the trace), so the file set cannot come from the
trace itself. It is the static import closure of a few roots (the model's modules, the passes'
files, the backend op modules the lowering picks, the tracing code): every project file those
import at module level, read with `ast`, not by importing. Imports inside functions are not
followed: that is what keeps registries (models/registry.py naming every family, the pass manager
naming every pass) from pulling all their entries into every key. A build records the files Dynamo
really traced (`compat.traced_files`) beside the hashed set; a test checks the first is inside the
second, so a dependency this closure misses shows up as a failing test, not a stale artifact.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("atomc", "models")  # the project's top-level packages; anything else is a dependency


def module_file(name: str, root: Path = ROOT) -> Path | None:
    """The file of project module `name` ('models.llama' -> models/llama.py), or None."""
    if name.split(".")[0] not in PACKAGES:
        return None
    base = root.joinpath(*name.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_statements(body: list[ast.stmt]) -> Iterable[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported: top level, in if/try/with blocks and class
    bodies, not in functions and not under `if TYPE_CHECKING:`."""
    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            yield stmt
        elif isinstance(stmt, ast.If):
            if not _is_type_checking(stmt.test):
                yield from _import_statements(stmt.body)
            yield from _import_statements(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for block in (stmt.body, stmt.orelse, stmt.finalbody, *[h.body for h in stmt.handlers]):
                yield from _import_statements(block)
        elif isinstance(stmt, (ast.With, ast.ClassDef)):
            yield from _import_statements(stmt.body)


def imported_modules(path: Path, root: Path = ROOT) -> frozenset[str]:
    """Names of the modules `path` imports at module level (each with its parent packages)."""
    st = path.stat()  # parsed once per process while the file is unchanged: plans run at every start
    return _imported_modules(path, root, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=1024)
def _imported_modules(path: Path, root: Path, _mtime_ns: int, _size: int) -> frozenset[str]:
    tree = ast.parse(path.read_bytes(), filename=str(path))
    package = _module_name(path, root) if path.name == "__init__.py" else _module_name(path, root).rpartition(".")[0]
    names: set[str] = set()
    for stmt in _import_statements(tree.body):
        if isinstance(stmt, ast.Import):
            names.update(a.name for a in stmt.names)
            continue
        base = stmt.module or ""
        if stmt.level:  # relative: from .x import y
            anchor = package.split(".")[: len(package.split(".")) - stmt.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        names.add(base)
        names.update(f"{base}.{a.name}" for a in stmt.names)  # `from pkg import submodule`
    out = set()
    for name in names:
        parts = name.split(".")
        out.update(".".join(parts[: i + 1]) for i in range(len(parts)))  # importing a.b.c runs a and a.b
    return frozenset(out)


def closure(roots: Iterable[str | Path], root: Path = ROOT) -> list[Path]:
    """Project files reached from `roots` (module names or file paths) through module-level imports."""
    pending = []
    for r in roots:
        if isinstance(r, Path):
            pending.append(r.resolve())
            pending += [module_file(m, root) for m in _parents(r.resolve(), root)]
        else:
            pending += [module_file(m, root) for m in _with_parents(r)]
    seen: set[Path] = set()
    while pending:
        p = pending.pop()
        if p is None or p in seen or not _inside(p, root):
            continue
        seen.add(p)
        pending += [module_file(m, root) for m in imported_modules(p, root)]
    return sorted(seen)


def _with_parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _parents(path: Path, root: Path) -> list[str]:
    if not _inside(path, root):
        return []
    return _with_parents(_module_name(path, root))[:-1]


def _inside(path: Path, root: Path) -> bool:
    return path.is_relative_to(root)


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:20]


def digests(files: Iterable[Path], root: Path = ROOT) -> dict[str, str]:
    """{relative path: content digest}: the `sources` factor, so a diff names the edited file."""
    return {str(p.relative_to(root)): file_digest(p) for p in sorted(files) if _inside(p, root)}


def project_files(paths: Iterable[str], root: Path = ROOT) -> list[str]:
    """The project files among `paths` (absolute file names), relative to the root."""
    out = set()
    for s in paths:
        p = Path(s).resolve()
        if p.suffix == ".py" and _inside(p, root) and p.parts[len(root.parts)] in PACKAGES:
            out.add(str(p.relative_to(root)))
    return sorted(out)
