"""The on-disk cache: `<root>/<key>/` entries, a lock per key, `.ready` written last by rename.

<root>/<key>/manifest.json      factors, pass report, partitions, sizes, timings, file checksums
<root>/<key>/model.aot          the artifact (or pieces/<sha>.bin for the fallback format)
<root>/<key>/graphs/NN_<pass>.py the graph after each pass, for reading
<root>/<key>/.ready             present only once everything above is complete
<root>/locks/<key>.lock         so two concurrent compiles of one key build once
<root>/inductor/                Inductor's cache, pinned here so warm loads find built kernels
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

MANIFEST = "manifest.json"
READY = ".ready"
_SKIP_DIRS = {"locks", "inductor"}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
        return json.loads((self.path / MANIFEST).read_text())

    def verify(self) -> list[str]:
        """Problems found: missing/extra-short/altered artifact files, or an unfinished entry."""
        if not (self.path / MANIFEST).is_file():
            return ["no manifest.json (unfinished compile)"]
        try:
            files = self.manifest()["files"]
        except (json.JSONDecodeError, KeyError) as e:
            return [f"manifest.json unreadable: {e}"]
        problems = [] if (self.path / READY).is_file() else ["no .ready marker (unfinished compile)"]
        for rel, meta in sorted(files.items()):
            p = self.path / rel
            if not p.is_file():
                problems.append(f"{rel}: missing")
            elif p.stat().st_size != meta["size"]:
                problems.append(f"{rel}: {p.stat().st_size} bytes, expected {meta['size']} (truncated?)")
            elif sha256_file(p) != meta["sha256"]:
                problems.append(f"{rel}: checksum mismatch (corrupt)")
        return problems

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())


class CacheStore:
    def __init__(self, root: Path | str):
        self.root = Path(root).expanduser()

    def entry(self, key: str) -> Entry:
        return Entry(self.root, key)

    @property
    def inductor_dir(self) -> Path:
        return self.root / "inductor"

    @contextlib.contextmanager
    def lock(self, key: str, timeout: float = -1):
        (self.root / "locks").mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.root / "locks" / f"{key}.lock"), timeout=timeout):
            yield

    def begin(self, key: str) -> Entry:
        """A clean directory for a build (call with the key's lock held): leftovers of a killed
        compile are removed, so a half-written entry never mixes with a new one."""
        e = self.entry(key)
        if e.path.exists():
            shutil.rmtree(e.path)
        e.path.mkdir(parents=True)
        return e

    def commit(self, entry: Entry, manifest: dict, artifact_files: list[str]) -> dict:
        """Checksum the artifact files into the manifest, write it, then `.ready` last by rename."""
        manifest["files"] = {
            rel: {"size": (entry.path / rel).stat().st_size, "sha256": sha256_file(entry.path / rel)}
            for rel in artifact_files
        }
        manifest["artifact_bytes"] = sum(f["size"] for f in manifest["files"].values())
        manifest["created"] = time.time()
        write_atomic(entry.path / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True, default=str).encode())
        write_atomic(entry.path / READY, b"")
        return manifest

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
            with contextlib.suppress(Exception):
                out[e.key] = e.manifest()["factors"]
        return out

    def remove(self, key: str) -> None:
        e = self.entry(key)
        with self.lock(key):
            # drop the marker first, so a concurrent reader never sees a ready entry half-deleted
            with contextlib.suppress(FileNotFoundError):
                (e.path / READY).unlink()
            shutil.rmtree(e.path, ignore_errors=True)
