"""The one way rayfl reads and writes inside a run, suite or sweep folder (docs/security.md).

A :class:`Folder` is a directory file descriptor; its children are opened relative to it with
``O_NOFOLLOW`` (a link is refused, never followed), read bounded (regular files, non-blocking,
size checked first) and replaced atomically (an ``O_EXCL`` temporary file renamed over it).
Every file rayfl writes is recorded (sha256) in the folder's manifest, authenticated with
HMAC-SHA256 under the user's key (:func:`secret`); what it reads back must match before it is
parsed, else one line (:class:`Refused`), unless a read-only command is :func:`untrusted`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import hmac
import io
import json
import os
import secrets
import shutil
import stat
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from rayfl.errors import UserError

MIB, GIB = 1 << 20, 1 << 30
JSON_LIMIT = 64 * MIB  # summary, history, mlflow_run, sweep state
TEXT_LIMIT = 16 * MIB  # config.yaml, table.txt, sweep.yaml, a manifest
TABLE_LIMIT = 1 * GIB  # a Parquet table, a file of Tune's state
MANIFEST = ".rayfl-manifest"
LOCK = ".lock"  # the pid of the process holding the folder (information only)
KEY_ENV = "RAYFL_KEY_FILE"
_MAC = b"rayfl-manifest/1\0"
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_WRITE, _trust, _KEYS = threading.Lock(), threading.local(), dict[str, bytes]()
_NOT_VOUCHED = (
    "was not written by your rayfl or was changed since (its folder's authenticated manifest "
    "does not vouch for it); report and ls-runs read others' folders with --untrusted"
)
_NOT_YOURS = (
    "its manifest is not authenticated by your key (written by someone else, or changed); "
    "report and ls-runs read others' folders with --untrusted"
)


class Refused(UserError):
    """A file or folder rayfl will not read or write (one line)."""


def refuse(path: Path | str, problem: str) -> Refused:
    return Refused(f"{path}: {problem}; see docs/security.md")


def key_path() -> Path:
    """``$RAYFL_KEY_FILE``, else ``~/.config/rayfl/key``."""
    return Path(os.environ.get(KEY_ENV) or Path.home() / ".config" / "rayfl" / "key")


def secret() -> bytes:
    """The user's 32-byte secret key, created (mode 0600) on first use; refused unless it is
    a regular 32-byte file owned by this user that nobody else may read."""
    path = key_path()
    if str(path) in _KEYS:
        return _KEYS[str(path)]
    try:
        if not path.exists():
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            with (
                contextlib.suppress(FileExistsError),
                os.fdopen(os.open(path, _NEW, 0o600), "wb") as f,
            ):
                f.write(secrets.token_bytes(32))
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise refuse(path, f"the key file cannot be opened ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise refuse(path, "the key file must be yours with mode 0600 (chmod 600 it)")
        key = f.read(33)
    if len(key) != 32:
        raise refuse(path, "the key file does not hold 32 bytes; move it away for a new key")
    _KEYS[str(path)] = key
    return key


def _mac(body: bytes) -> bytes:
    return hmac.new(secret(), _MAC + body, hashlib.sha256).hexdigest().encode()


@contextlib.contextmanager
def untrusted(on: bool = True) -> Iterator[None]:
    """Reads in this thread skip authentication (a colleague's folder, read-only commands);
    writes through the gate are refused meanwhile (``on=False``: back to normal inside)."""
    before = is_untrusted()
    _trust.off = on
    try:
        yield
    finally:
        _trust.off = before


def is_untrusted() -> bool:
    return bool(getattr(_trust, "off", False))


def _open(path: Path, name: str, flags: int, dir_fd: int) -> int:
    """``os.open`` of ``name`` relative to ``dir_fd``; a link or another failure is one line."""
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        link = exc.errno in (errno.ELOOP, errno.ENOTDIR)
        why = "is a symbolic link" if link else f"cannot be opened ({exc.strerror})"
        raise refuse(path, why) from None


class Folder:
    """A directory held open; every name is relative to it and never followed through a link.

    The folder itself is the one the user named (a link to it is the user's choice); a
    :meth:`sub` folder is opened with ``O_NOFOLLOW`` component by component."""

    def __init__(self, path: str | Path, create: bool = False, _fd: int | None = None) -> None:
        self.path = Path(path)
        if _fd is None:
            try:
                if create:
                    self.path.mkdir(parents=True, exist_ok=True)
                _fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise
            except OSError as exc:
                raise refuse(self.path, f"is no folder rayfl can use ({exc.strerror})") from None
        self.fd = _fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Folder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def kind(self, name: str) -> str | None:
        """``file``, ``dir``, ``link`` or ``other`` (never followed), None when missing."""
        try:
            mode = os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return None
        for test, kind in ((stat.S_ISREG, "file"), (stat.S_ISDIR, "dir"), (stat.S_ISLNK, "link")):
            if test(mode):
                return kind
        return "other"

    def names(self) -> list[str]:
        return sorted(os.listdir(self.fd))

    def sub(self, name: str, create: bool = False) -> Folder:
        """The folder ``name`` (``a/b`` walks both) inside this one; a link on the way is
        refused. Raises FileNotFoundError when it is missing and ``create`` is False."""
        fd = self.fd
        for part in Path(name).parts:
            if part in ("..", "/"):
                raise refuse(self.path / name, "leaves its folder")
            if create:
                self._check_writable()
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
            try:
                new = _open(self.path / name, part, _DIR, fd)
            finally:
                if fd != self.fd:
                    os.close(fd)
            fd = new
        return Folder(self.path / name, _fd=fd if fd != self.fd else os.dup(fd))

    def read_raw(self, name: str, limit: int) -> bytes:
        """The bytes of the regular file ``name`` (at most ``limit``), not authenticated."""
        head, _, base = name.rpartition("/")
        parent = self.sub(head) if head else self
        try:
            fd = _open(self.path / name, base, _FILE, parent.fd)
        finally:
            if parent is not self:
                parent.close()
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise refuse(self.path / name, "is not a regular file (a FIFO, device, folder)")
            if st.st_size > limit:
                raise refuse(self.path / name, f"is {st.st_size} bytes, over the limit {limit}")
            data = f.read(limit + 1)
        if len(data) > limit:
            raise refuse(self.path / name, f"is over the limit of {limit} bytes")
        return data

    def read(self, name: str, limit: int) -> bytes:
        """The bytes of ``name``, refused unless this folder's authenticated manifest records
        their sha256 (skipped inside :func:`untrusted`)."""
        data = self.read_raw(name, limit)
        digest = hashlib.sha256(data).hexdigest()
        if not is_untrusted() and digest not in self.manifest().get(name, []):
            raise refuse(self.path / name, _NOT_VOUCHED)
        return data

    def manifest(self) -> dict[str, list[str]]:
        """``name -> [sha256, ...]`` of this folder, its HMAC checked before it is parsed."""
        try:
            raw = self.read_raw(MANIFEST, TEXT_LIMIT)
        except FileNotFoundError:
            return {}
        mac, _, body = raw.partition(b"\n")
        if not hmac.compare_digest(mac, _mac(body)):
            raise refuse(self.path, _NOT_YOURS)
        return json.loads(body)  # type: ignore[no-any-return]

    def _check_writable(self) -> None:
        if is_untrusted():
            raise refuse(self.path, "a read-only command with --untrusted writes nothing")

    def _replace(self, name: str, data: bytes) -> None:
        tmp = f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        try:
            with os.fdopen(os.open(tmp, _NEW, 0o644, dir_fd=self.fd), "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=self.fd)

    @contextlib.contextmanager
    def _manifest_update(self) -> Iterator[dict[str, list[str]]]:
        """The manifest to change in the body, saved after it; held against this process's
        threads and other processes writing the folder (``flock``)."""
        self._check_writable()
        with _WRITE:
            fd = os.open(
                MANIFEST + ".lock",
                os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o644,
                dir_fd=self.fd,
            )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                entries = self.manifest()
                yield entries
                body = json.dumps(entries, sort_keys=True).encode()
                self._replace(MANIFEST, _mac(body) + b"\n" + body)
            finally:
                os.close(fd)

    def write(self, name: str, data: bytes, record: bool = True) -> Path:
        """Replace ``name`` with ``data`` atomically and, with ``record``, record its sha256:
        both hashes are recorded while it is replaced, so a crash at any moment leaves a file
        the manifest vouches for."""
        self._check_writable()
        if "/" in name:
            raise refuse(self.path / name, "is not a name in this folder")
        if not record:
            self._replace(name, data)
            return self.path / name
        digest = hashlib.sha256(data).hexdigest()
        with self._manifest_update() as entries:
            entries[name] = [*entries.get(name, [])[-1:], digest]
        self._replace(name, data)
        with self._manifest_update() as entries:
            entries[name] = [digest]
        return self.path / name

    def record(self, name: str, data: bytes) -> None:
        """Record the sha256 of ``data``, written to ``name`` otherwise (a checkpoint file)."""
        with self._manifest_update() as entries:
            entries[name] = [hashlib.sha256(data).hexdigest()]

    def remove(self, name: str) -> None:
        """Remove the file, link or (not following links) folder tree ``name``, if there."""
        self._check_writable()
        if self.kind(name) == "dir":
            shutil.rmtree(name, dir_fd=self.fd)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=self.fd)

    def point(self, link: str, target: str) -> None:
        """Make ``link`` a symlink to the sibling ``target`` by one atomic rename."""
        self._check_writable()
        tmp = f".{link}.link-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        os.symlink(target, tmp, dir_fd=self.fd)
        os.replace(tmp, link, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        os.fsync(self.fd)

    def target(self, link: str) -> str | None:
        """Where the symlink ``link`` points (a sibling's name), None when it is no link."""
        try:
            return os.readlink(link, dir_fd=self.fd)
        except OSError:
            return None

    def lock(self) -> bool:
        """Take this folder's exclusive ``flock`` without waiting (False when another process
        holds it) and write this pid into ``.lock``; the kernel drops it when the holder dies."""
        self._check_writable()
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self._replace(LOCK, f"{os.getpid()}\n".encode())
        return True

    def unlock(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(LOCK, dir_fd=self.fd)
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def held(self) -> bool:
        """Whether another process holds the folder's lock now (only looks)."""
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def owner(self) -> int | None:
        """The pid the holder wrote (best effort), or None."""
        try:
            text = self.read_raw(LOCK, 64).decode(errors="replace").strip()
        except (OSError, Refused):
            return None
        return int(text) if text.isdigit() else None


# ------------------------------------------------------------------- by path and by kind


def read(path: str | Path, limit: int) -> bytes:
    """The authenticated bytes of the file ``path`` (see :meth:`Folder.read`)."""
    path = Path(path)
    with Folder(path.parent) as folder:
        return folder.read(path.name, limit)


def write(path: str | Path, data: bytes) -> Path:
    """Write ``path`` atomically and record it in its folder's manifest."""
    path = Path(path)
    with Folder(path.parent, create=True) as folder:
        return folder.write(path.name, data)


def write_with(path: str | Path, fn: Callable[[IO[bytes]], Any]) -> Path:
    """:func:`write` of what ``fn`` writes into a buffer (a Parquet writer, ``savefig``)."""
    buf = io.BytesIO()
    fn(buf)
    return write(path, buf.getvalue())


def read_json(path: str | Path, limit: int = JSON_LIMIT) -> Any:
    """An authenticated JSON file, else one line."""
    try:
        return json.loads(read(path, limit))
    except (ValueError, RecursionError):
        raise refuse(path, "is not valid JSON") from None


def read_text(path: str | Path, limit: int = TEXT_LIMIT) -> str:
    """An authenticated UTF-8 text file, else one line."""
    try:
        return read(path, limit).decode("utf-8")
    except UnicodeDecodeError:
        raise refuse(path, "is not UTF-8 text") from None


@contextlib.contextmanager
def locked(path: str | Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the file ``path`` (created, never through a link) for the
    body of a ``with`` block, waiting for it; the kernel drops it if this process dies."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
