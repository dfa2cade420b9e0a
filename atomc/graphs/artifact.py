"""Saving and loading the compiled model, in two formats behind one manifest.

- `aot_fn` (primary): torch's AOT compile of the whole forward, one file. Loading it runs neither
  Dynamo nor Inductor.
- `pieces` (fallback, if the experimental aot APIs break on a torch bump): the graph is FX-split at
  the splitting ops and each graph piece goes through `standalone_compile`, stored by content hash
  (identical layers share one file). Loading re-runs the Dynamo trace (no Inductor) and swaps the
  stored pieces in.

Both load from a private copy of a verified entry (build.py), never from the cache in place.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from atomc import compat
from atomc.graphs import pickle_scan
from atomc.graphs.partition import split_graph

log = logging.getLogger(__name__)

AOT_FILE = "model.aot"
PIECES_DIR = "pieces"


# torch's loading of an AOT-compiled function is not thread-safe: two threads of one process loading
# at once (a builder after its build, a waiter after the lock) once got a guard function built with
# the other's arguments (tests/graphs/test_faults.py, concurrent compiles). One load at a time.
_LOAD_LOCK = threading.Lock()


class ArtifactError(RuntimeError):
    """The artifact is missing, corrupt, or was built for something else."""


def save_aot(compiled, entry_dir: Path) -> list[str]:
    compat.save_compiled_function(compiled, str(entry_dir / AOT_FILE))
    return [AOT_FILE]


def load_aot(entry_dir: Path, platform: str = "cpu") -> Callable:
    """The compiled `forward(model, input_ids, positions)`. The pickle is scanned first: on a platform
    whose artifacts the allow-list has been checked against (pickle_scan.ENFORCED_PLATFORMS), a global
    outside it refuses the file before torch reads it; elsewhere the finding is logged and the entry's
    signature alone vouches for the file (pickle_scan.py says why)."""
    data = (entry_dir / AOT_FILE).read_bytes()
    try:
        pickle_scan.scan(data, where=AOT_FILE)
    except pickle_scan.UnsafePickle as e:
        if platform in pickle_scan.ENFORCED_PLATFORMS:
            raise ArtifactError(f"refused: {e}") from None
        log.warning(
            "the artifact scan would refuse this %s artifact (%s); its allow-list is not yet checked "
            "against %s artifacts, so the entry's signature alone admits it", platform, e, platform,
        )  # fmt: skip
    try:
        with _LOAD_LOCK:
            return compat.load_compiled_function(data)
    except Exception as e:
        raise ArtifactError(f"{entry_dir / AOT_FILE} could not be loaded: {type(e).__name__}: {e}") from e


KERNELS_DIR = "inductor"


def keep_kernels(entry_dir: Path) -> list[str]:
    """Of the Inductor cache a build ran in (`<entry>/inductor/`), keep only the compiled kernels
    (`*.so`), which a CPU load dlopens instead of rebuilding them (16-22 s on the tiny model).
    Everything else there is either rewritten by a load from the artifact itself (Inductor's
    generated `.py`/`.cpp`, which it writes from the source the artifact carries) or only a build
    uses (its FX-graph and autotune caches). Returns the kept files, relative to the entry."""
    root = entry_dir / KERNELS_DIR
    if not root.is_dir():
        return []
    kept = []
    for p in sorted(root.rglob("*"), reverse=True):  # files before the folders that hold them
        if p.is_symlink() or (p.is_file() and p.suffix != ".so"):
            p.unlink()
        elif p.is_file():
            kept.append(p.relative_to(entry_dir).as_posix())
        elif p.is_dir() and not any(p.iterdir()):
            p.rmdir()
    return sorted(kept)


def piece_hash(gm: torch.fx.GraphModule, args: list) -> str:
    """Content id of a graph piece: its code plus its input shapes/dtypes."""
    # symbolic dims are named per trace (u0, u3...): hash them as "?" so a re-trace matches
    sig = [
        (str(a.dtype), [s if isinstance(s, int) else "?" for s in a.shape])
        if isinstance(a, torch.Tensor)
        else type(a).__name__
        for a in args
    ]
    # placeholder names carry the layer index (…layers_modules_3…): rename them by position so
    # identical layers hash (and are stored) once
    code = gm.code
    for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        code = re.sub(rf"\b{re.escape(n.name)}\b", f"arg{i}", code)
    return hashlib.sha256((code + repr(sig)).encode()).hexdigest()[:32]


class _PieceRunner(torch.fx.Interpreter):
    """Walks the split graph on fake inputs, handing each graph piece (with its fake args) to `visit`."""

    def __init__(self, split: torch.fx.GraphModule, order: list[tuple[str, bool]], visit):
        super().__init__(split)
        self.splitting = {name for name, is_split in order if is_split}
        self.visit = visit

    def call_module(self, target, args, kwargs):
        sub = getattr(self.module, target)
        out = sub(*args, **kwargs)
        if target not in self.splitting:
            self.visit(target, sub, list(args))
        return out


def _walk(gm: torch.fx.GraphModule, example_inputs: list, visit) -> torch.fx.GraphModule:
    """Split `gm` and call visit(name, split, piece, fake_args) for each graph piece in order."""
    # run on the trace's own fake values (symbolic token dim), not the real example tensors
    fakes = [n.meta.get("example_value", n.meta.get("val")) for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = next(v.fake_mode for v in fakes if hasattr(v, "fake_mode"))
    split, order = split_graph(gm)
    with fake_mode, torch.no_grad():
        _PieceRunner(split, order, lambda name, sub, args: visit(name, split, sub, args)).run(*fakes)
    return split


def compile_pieces(entry_dir: Path, files: list[str], pieces: list[str]):
    """An AtomcBackend compile_fn for the fallback format: compile and store each unique piece."""

    def compile_fn(gm, example_inputs, splitting_ops):
        (entry_dir / PIECES_DIR).mkdir(exist_ok=True)
        compat.register_inductor_fallbacks(gm)  # as inductor_compile does (compat says why)
        loaded: list[tuple[str, _Loaded]] = []

        def visit(name, split, sub, args):
            digest = piece_hash(sub, args)
            rel = f"{PIECES_DIR}/{digest}.bin"
            (entry_dir / PIECES_DIR / f"{digest}.py").write_text(sub.code)  # for reading, not loaded
            if rel not in files:
                try:
                    compiled = compat.standalone_compile(sub, args) if _has_compute(sub) else None
                except RuntimeError:  # e.g. a piece that only allocates: Inductor leaves nothing to save
                    compiled = None
                if compiled is None:  # run this piece as plain FX code (re-traced on load)
                    pieces.append(EAGER + digest)
                    return
                compiled.save(path=str(entry_dir / rel), format="binary")
                files.append(rel)
            pieces.append(digest)
            loaded.append((name, _Loaded(entry_dir / rel, _single_output(sub))))

        split = _walk(gm, example_inputs, visit)
        for name, piece in loaded:  # swapped in after the walk, which must run the original pieces
            setattr(split, name, piece)
        split.recompile()
        return split

    return compile_fn


EAGER = "eager:"
_NO_COMPUTE = {"getitem", "view", "reshape", "_unsafe_view", "split", "chunk", "contiguous", "size", "sym_size"}


def _has_compute(gm: torch.fx.GraphModule) -> bool:
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method"):
            if getattr(n.target, "__name__", str(n.target)).split(".")[-1] not in _NO_COMPUTE:
                return True
    return False


def _single_output(gm: torch.fx.GraphModule) -> bool:
    # split_module pieces with one output return it bare; a compiled piece always returns a list
    return isinstance(next(iter(reversed(gm.graph.nodes))).args[0], torch.fx.Node)


class _Loaded(torch.nn.Module):
    """A stored piece, loaded on first call (Dynamo's fake run never calls it)."""

    def __init__(self, path: Path, single: bool):
        super().__init__()
        self.path, self.single = path, single
        self.fn = None

    def forward(self, *args):
        if self.fn is None:
            self.fn = compat.load_standalone(str(self.path))
        out = self.fn(*args)
        return out[0] if self.single else out


def load_pieces_backend(entry_dir: Path, pieces: list[str]):
    """An AtomcBackend compile_fn that re-splits the freshly traced graph and loads stored pieces."""

    def compile_fn(gm, example_inputs, splitting_ops):
        found: list[tuple[str, str, bool]] = []

        def visit(name, split, sub, args):
            found.append((name, piece_hash(sub, args), _single_output(sub)))

        split = _walk(gm, example_inputs, visit)
        if [d for _, d, _ in found] != [p.removeprefix(EAGER) for p in pieces]:
            raise ArtifactError("the traced graph's pieces differ from the stored ones (stale artifact)")
        for (name, digest, single), stored in zip(found, pieces, strict=True):
            if stored.startswith(EAGER):
                continue
            piece = _Loaded(entry_dir / PIECES_DIR / f"{digest}.bin", single)
            piece.fn = compat.load_standalone(str(piece.path))
            setattr(split, name, piece)
        split.recompile()
        return split

    return compile_fn
