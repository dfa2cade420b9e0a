"""The on-disk cache: `<root>/<key>/` entries, a lock per key, `.ready` written last by rename.

<root>/<key>/manifest.json      factors, pass report, partitions, sizes, timings, file checksums
<root>/<key>/model.aot          the artifact (or pieces/<sha>.bin for the fallback format)
<root>/<key>/inductor/**.so     the C++ kernels Inductor built for this entry (a CPU load dlopens them)
<root>/<key>/graphs/NN_<pass>.py the graph after each pass, for reading
<root>/<key>/.ready             written last: the HMAC of manifest.json under the signing key (signing.py)
<root>/locks/<key>.lock         so two concurrent compiles of one key build once
<root>/models/<name>/           converted checkpoints (.gguf -> HF folder), not compile entries

Trust: an entry is code (pickled Python bytecode, Inductor's generated source, `.so` files; see
docs/compilation.md). It is signed (`.ready` is a MAC of the manifest, which lists every file's
sha256), created private (0700 dirs, 0600 files, whatever the umask), and an entry not owned by this
user, or writable by group or others, is refused (`Entry.trust_problems`). A load never reads the
entry in place: `Entry.check(key, stage_to=dir)` copies each listed file into a private folder while
hashing it, so what is loaded is exactly what was checked (no window to swap a file between the
check and the use). A manifest gets a schema check (`manifest_problems`): one that is valid JSON but
wrong is a damaged entry (rebuilt), never a traceback.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from atomc.graphs import signing
from atomc.graphs.signing import SignatureProblem, SigningKey

MANIFEST = "manifest.json"
READY = ".ready"
MODELS_DIR = "models"
# "inductor": where Inductor's cache was pinned before entries carried their own kernels
_SKIP_DIRS = {"locks", "inductor", MODELS_DIR}
_FORMATS = ("aot_fn", "pieces")
_HEX64 = frozenset("0123456789abcdef")


class ManifestError(ValueError):
    """manifest.json is missing, not JSON, or not the shape atomc writes."""


def manifest_problems(m) -> list[str]:
    """What is wrong with a decoded manifest (empty: the fields loading reads are there and sane)."""
    if not isinstance(m, dict):
        return ["manifest is not a JSON object"]
    problems = []
    if not isinstance(m.get("key"), str):
        problems.append("key is missing")
    if m.get("format") not in _FORMATS:
        problems.append(f"format {m.get('format')!r} is not one of {', '.join(_FORMATS)}")
    factors = m.get("factors")
    if not isinstance(factors, dict) or not isinstance(factors.get("system"), dict):
        problems.append("factors.system is missing")
    elif not isinstance(factors["system"].get("platform"), str):
        problems.append("factors.system.platform is missing")
    files = m.get("files")
    if not isinstance(files, dict):
        problems.append("files is missing")
    else:
        for rel, meta in files.items():
            parts = Path(rel).parts
            if not isinstance(rel, str) or Path(rel).is_absolute() or ".." in parts or not parts:
                problems.append(f"files: {rel!r} is not a path inside the entry")
            elif not isinstance(meta, dict) or not isinstance(meta.get("size"), int) or meta["size"] < 0:
                problems.append(f"files: {rel}: no size")
            elif not isinstance(meta.get("sha256"), str) or len(meta["sha256"]) != 64 or set(meta["sha256"]) - _HEX64:
                problems.append(f"files: {rel}: no sha256")
    if m.get("format") == "pieces" and not (
        isinstance(m.get("pieces"), list) and all(isinstance(p, str) for p in m["pieces"])
    ):
        problems.append("pieces is missing")
    return problems


def make_private_dir(path: Path) -> None:
    """mkdir -p with 0700 on the directories it creates, whatever the umask."""
    path = Path(path)
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            d.mkdir(mode=0o700)
            os.chmod(d, 0o700)  # mkdir's mode is filtered by the umask; chmod is not


def make_private(path: Path) -> None:
    """0700 on `path` and every directory under it, 0600 on every file (what torch wrote included)."""
    os.chmod(path, 0o700)
    for dirpath, dirnames, filenames in os.walk(path):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o700)
        for f in filenames:
            fp = os.path.join(dirpath, f)
            if not os.path.islink(fp):
                os.chmod(fp, 0o600)


def sha256_file(path: Path, copy_to: Path | None = None) -> str:
    """The file's sha256; with `copy_to`, the bytes hashed are also written there (0600), so the copy
    is exactly what was hashed, whatever happens to `path` meanwhile."""
    h = hashlib.sha256()
    with contextlib.ExitStack() as stack:
        f = stack.enter_context(open(path, "rb"))
        out = None
        if copy_to is not None:
            make_private_dir(copy_to.parent)
            out = stack.enter_context(open(os.open(copy_to, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb"))
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            if out is not None:
                out.write(chunk)
    return h.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _decode_manifest(key: str, data: bytes) -> dict:
    try:
        m = json.loads(data)
    except ValueError as e:
        raise ManifestError(f"{key}: manifest.json unreadable: {e}") from None
    problems = manifest_problems(m)
    if problems:
        raise ManifestError(f"{key}: manifest.json is not valid: {'; '.join(problems)}")
    return m


@dataclass
class EntryCheck:
    """What `Entry.check` found: the verified manifest (None if any problem), the problems, and the
    signature's own problem (its kind decides between rebuilding and refusing)."""

    manifest: dict | None
    problems: list[str]
    signature: SignatureProblem | None = None


@dataclass
class Entry:
    root: Path
    key: str

    @property
    def path(self) -> Path:
        return self.root / self.key

    @property
    def ready(self) -> bool:
        return (self.path / READY).is_file() and (self.path / MANIFEST).is_file()

    def manifest(self) -> dict:
        """The decoded manifest, unverified (for listing and reports; loading uses `check`);
        ManifestError when it is unreadable or not the shape atomc writes."""
        try:
            data = (self.path / MANIFEST).read_bytes()
        except OSError as e:
            raise ManifestError(f"{self.key}: manifest.json unreadable: {e}") from None
        return _decode_manifest(self.key, data)

    def trust_problems(self) -> list[str]:
        """Why this entry must not be loaded as code: not owned by us, or writable by others."""
        if not hasattr(os, "getuid"):
            return []
        uid, problems = os.getuid(), []
        paths = [self.path, *(p for p in self.path.rglob("*") if not p.is_symlink())]
        for p in paths:
            st = p.lstat()
            rel = p.relative_to(self.path).as_posix() if p != self.path else "."
            if st.st_uid != uid:
                problems.append(f"{rel} is owned by uid {st.st_uid}, not by this user ({uid})")
            elif st.st_mode & 0o022:
                problems.append(f"{rel} is writable by group or others (mode {st.st_mode & 0o777:o})")
            if len(problems) >= 3:
                break
        return problems

    def check(self, key: SigningKey, stage_to: Path | None = None) -> EntryCheck:
        """Signature, manifest schema, then every listed file's size and sha256. With `stage_to`,
        the files are copied there as they are hashed (for loading), and the check stops at the
        first problem: nothing of a refused entry is copied."""
        if not (self.path / MANIFEST).is_file():
            return EntryCheck(None, ["no manifest.json (unfinished compile)"])
        try:
            manifest_bytes = (self.path / MANIFEST).read_bytes()
            ready_text = (self.path / READY).read_text(errors="replace")
        except FileNotFoundError:
            return EntryCheck(None, ["no .ready marker (unfinished compile)"])
        except OSError as e:
            return EntryCheck(None, [f"unreadable: {e}"])
        sig = signing.check(key, ready_text, manifest_bytes)
        problems = [sig.message] if sig else []
        if sig and stage_to is not None:
            return EntryCheck(None, problems, sig)
        try:
            m = _decode_manifest(self.key, manifest_bytes)
        except ManifestError as e:
            return EntryCheck(None, [*problems, str(e).split(": ", 1)[1]], sig)
        if m["key"] != self.key:
            problems.append(f"manifest.json is for key {m['key']}, not for its folder {self.key}")
        for rel, meta in sorted(m["files"].items()):
            if problems and stage_to is not None:
                break
            p = self.path / rel
            if not p.is_file():
                problems.append(f"{rel}: missing")
            elif p.stat().st_size != meta["size"]:
                problems.append(f"{rel}: {p.stat().st_size} bytes, expected {meta['size']} (truncated?)")
            elif sha256_file(p, stage_to / rel if stage_to is not None else None) != meta["sha256"]:
                problems.append(f"{rel}: checksum mismatch (corrupt or altered)")
        return EntryCheck(None if problems else m, problems, sig)

    def verify(self, key: SigningKey) -> list[str]:
        """Problems found: an unsigned, foreign-signed or altered entry, a malformed manifest,
        missing/truncated/altered files, or an unfinished entry (empty: the entry would load)."""
        return self.check(key).problems

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())


@dataclass
class ConvertedModel:
    """A checkpoint converted into `<root>/models/` (a .gguf turned into an HF folder)."""

    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def complete(self) -> bool:
        from models.loader.gguf import is_converted

        return is_converted(self.path)

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())


class CacheStore:
    def __init__(self, root: Path | str):
        self.root = Path(root).expanduser()

    def entry(self, key: str) -> Entry:
        return Entry(self.root, key)

    @property
    def legacy_inductor_dir(self) -> Path:
        """Where Inductor's cache was pinned before each entry carried its own kernels (removed by
        `atomc cache clear --all`; nothing reads it)."""
        return self.root / "inductor"

    @property
    def models_dir(self) -> Path:
        return self.root / MODELS_DIR

    @property
    def writable(self) -> bool:
        """Can this process create entries here? (An image with artifacts baked in may say no.)"""
        p = self.root
        while not p.exists():
            p = p.parent
        return os.access(p, os.W_OK | os.X_OK)

    @contextlib.contextmanager
    def lock(self, key: str, timeout: float = -1):
        make_private_dir(self.root / "locks")
        with FileLock(str(self.root / "locks" / f"{key}.lock"), timeout=timeout, mode=0o600):
            yield

    def begin(self, key: str) -> Entry:
        """A clean directory for a build (call with the key's lock held): leftovers of a killed
        compile are removed, so a half-written entry never mixes with a new one."""
        e = self.entry(key)
        if e.path.exists():
            shutil.rmtree(e.path)
        make_private_dir(e.path)
        return e

    def commit(self, entry: Entry, manifest: dict, artifact_files: list[str], key: SigningKey) -> dict:
        """Checksum the artifact files into the manifest, write it, then `.ready` (its signature)
        last by rename; every file of the entry ends private (0600, dirs 0700)."""
        manifest["files"] = {
            rel: {"size": (entry.path / rel).stat().st_size, "sha256": sha256_file(entry.path / rel)}
            for rel in artifact_files
        }
        manifest["artifact_bytes"] = sum(f["size"] for f in manifest["files"].values())
        manifest["created"] = time.time()
        make_private(entry.path)
        self.write_manifest(entry, manifest, key)
        return manifest

    @staticmethod
    def write_manifest(entry: Entry, manifest: dict, key: SigningKey) -> None:
        data = json.dumps(manifest, indent=2, sort_keys=True, default=str).encode()
        write_atomic(entry.path / MANIFEST, data)
        write_atomic(entry.path / READY, key.sign(data).encode())

    def converted_models(self) -> list[ConvertedModel]:
        if not self.models_dir.is_dir():
            return []
        return [ConvertedModel(p) for p in sorted(self.models_dir.iterdir()) if p.is_dir()]

    def keys(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and p.name not in _SKIP_DIRS)

    def entries(self, ready_only: bool = False) -> list[Entry]:
        out = [self.entry(k) for k in self.keys()]
        return [e for e in out if e.ready] if ready_only else out

    def resolve(self, prefix: str) -> Entry:
        """An entry by key or unique key prefix."""
        matches = [k for k in self.keys() if k.startswith(prefix)]
        if len(matches) != 1:
            what = "no entry" if not matches else f"{len(matches)} entries"
            raise KeyError(f"{what} match {prefix!r} in {self.root}")
        return self.entry(matches[0])

    def ready_factors(self) -> dict[str, dict]:
        out = {}
        for e in self.entries(ready_only=True):
            with contextlib.suppress(ManifestError):
                out[e.key] = e.manifest()["factors"]
        return out

    def remove(self, key: str) -> None:
        e = self.entry(key)
        with self.lock(key):
            # drop the marker first, so a concurrent reader never sees a ready entry half-deleted
            with contextlib.suppress(FileNotFoundError):
                (e.path / READY).unlink()
            shutil.rmtree(e.path, ignore_errors=True)
