"""Compile cache entries are signed: `.ready` holds an HMAC-SHA256 of manifest.json under a key kept
outside the cache.

The manifest lists every file a load reads with its sha256, so one MAC over the manifest's bytes
covers the whole entry. A checksum alone stops corruption; the MAC stops tampering by anyone who can
write the cache but cannot read the key (an artifact is code: see docs/compilation.md, "What the
cache trusts").

The key is a file: `--cache-signing-key-file`, else `ATOMC_CACHE_SIGNING_KEY_FILE`, else a per-user
key created on first use in atomc's config folder (0600 in a 0700 folder). A deployment that ships
a prebuilt cache ships the key with its other secrets. Where the key lives is not a compile cache
factor; which key signed an entry is told by a key id (a hash of the key, which reveals nothing of it).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from atomc import env

log = logging.getLogger(__name__)

SCHEME = "atomc-hmac-sha256-v1"
MIN_SECRET_BYTES = 32
_warned_readable: set[str] = set()


class SigningKeyError(RuntimeError):
    """The signing key file is missing (and may not be created), unreadable, too short or unsafe."""


@dataclass(frozen=True)
class SigningKey:
    secret: bytes
    path: Path

    @property
    def key_id(self) -> str:
        """Names the key in messages and in `.ready` (a one-way hash: it tells keys apart, nothing more)."""
        return hashlib.sha256(b"atomc cache signing key id\0" + self.secret).hexdigest()[:16]

    def mac(self, manifest_bytes: bytes) -> str:
        return hmac.new(self.secret, b"atomc cache entry\0" + manifest_bytes, hashlib.sha256).hexdigest()

    def sign(self, manifest_bytes: bytes) -> str:
        """The text of `.ready`."""
        return f"{SCHEME} {self.key_id} {self.mac(manifest_bytes)}\n"


# what is wrong with a signature; the loader rebuilds or refuses by kind
UNSIGNED, OTHER_KEY, BAD_MAC = "unsigned", "other-key", "bad-mac"


@dataclass(frozen=True)
class SignatureProblem:
    kind: str
    message: str


def check(key: SigningKey, ready_text: str, manifest_bytes: bytes) -> SignatureProblem | None:
    """None when `.ready` is this key's MAC of exactly these manifest bytes."""
    parts = ready_text.split()
    if len(parts) != 3 or parts[0] != SCHEME:
        return SignatureProblem(UNSIGNED, "entry is not signed (built before atomc signed its cache entries)")
    _, key_id, mac = parts
    if not hmac.compare_digest(key_id, key.key_id):
        return SignatureProblem(
            OTHER_KEY, f"entry is signed with key {key_id}, not with this process's key {key.key_id} ({key.path})"
        )
    if not hmac.compare_digest(mac, key.mac(manifest_bytes)):
        return SignatureProblem(BAD_MAC, "manifest.json does not match its signature in .ready (altered)")
    return None


def key_path(configured: str | os.PathLike | None) -> Path:
    """The key file a config names (`compile.cache_signing_key_file`), else the environment's default."""
    return Path(configured).expanduser() if configured else env.signing_key_file()


def load_key(configured: str | os.PathLike | None = None, *, create: bool = True) -> SigningKey:
    """The signing key; created (32 random bytes as hex, 0600, folder 0700) when absent and `create`."""
    path = key_path(configured)
    if not path.exists():
        if not create:
            raise SigningKeyError(f"no compile cache signing key at {path}")
        _create(path)
    try:
        st = path.stat()  # follows links: a mounted secret is often a link into its volume
        if not stat.S_ISREG(st.st_mode):
            raise SigningKeyError(f"the compile cache signing key {path} is not a regular file")
        if st.st_mode & 0o022:
            raise SigningKeyError(
                f"the compile cache signing key {path} is writable by group or others (mode "
                f"{st.st_mode & 0o777:o}): anyone who can change it can sign entries; chmod 600 it"
            )
        secret = path.read_bytes().strip()
    except OSError as e:
        raise SigningKeyError(f"the compile cache signing key {path} cannot be read: {e}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise SigningKeyError(
            f"the compile cache signing key {path} holds {len(secret)} bytes; it needs at least "
            f"{MIN_SECRET_BYTES} (atomc creates 64 random hex digits)"
        )
    if st.st_mode & 0o044 and str(path) not in _warned_readable:
        _warned_readable.add(str(path))
        log.warning(
            "the compile cache signing key %s is readable by group or others (mode %o)", path, st.st_mode & 0o777
        )
    return SigningKey(secret, path)


def _create(path: Path) -> None:
    """Write a new key without a window where it exists half-written or readable by others; a
    concurrent creator's key wins the race and is the one both use."""
    folder = path.parent
    if not folder.exists():
        try:
            folder.mkdir(parents=True, mode=0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise SigningKeyError(
                f"no compile cache signing key at {path}, and it cannot be created ({e}); "
                "give one with --cache-signing-key-file or ATOMC_CACHE_SIGNING_KEY_FILE"
            ) from None
        with contextlib.suppress(OSError):
            os.chmod(folder, 0o700)  # mkdir's mode is filtered by the umask
    tmp = folder / f".{path.name}.tmp{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(secrets.token_hex(32) + "\n")
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)  # fails if another process created it first: theirs is kept
    except OSError as e:
        raise SigningKeyError(
            f"no compile cache signing key at {path}, and it cannot be created ({e}); "
            "give one with --cache-signing-key-file or ATOMC_CACHE_SIGNING_KEY_FILE"
        ) from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    log.info("created the compile cache signing key %s", path)
