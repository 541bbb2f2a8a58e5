"""The one way rayfl reads and writes inside a run, suite or sweep folder (docs/security.md).

A :class:`Folder` is opened once as a directory file descriptor; its children are opened and
created relative to it with ``O_NOFOLLOW`` (a link in a child's path is refused, never
followed), read bounded (regular files only, opened non-blocking, size checked before a byte is
read), and written atomically (a temporary file created with ``O_EXCL`` and renamed over the
name inside the same directory).

Integrity replaces inspection: every file rayfl writes into a folder has its sha256 recorded in
the folder's manifest (``.rayfl-manifest``), and the manifest is authenticated with
HMAC-SHA256 under the user's secret key (:func:`secret`). What rayfl reads back must be in a
valid manifest with a matching hash, checked before a byte of it is parsed; anything else is
one line (:class:`Refused`). Read-only commands may look at a folder they cannot authenticate
inside :func:`untrusted` (``--untrusted``): reads are still bounded, nothing is written.
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
import stat
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from rayfl.errors import UserError

MIB, GIB = 1 << 20, 1 << 30
JSON_LIMIT = 64 * MIB  # summary, history, mlflow_run, sweep state
TEXT_LIMIT = 16 * MIB  # config.yaml, table.txt, sweep.yaml
TABLE_LIMIT = 1 * GIB  # Parquet tables
STATE_LIMIT = 16 * GIB  # one checkpoint state (.npz)
MAX_ROWS, MAX_COLUMNS = 2_000_000, 20_000  # a Parquet table read back (checked before decoding)
MANIFEST = ".rayfl-manifest"
LOCK = ".lock"  # the pid of the process holding the folder (information only)
KEY_ENV = "RAYFL_KEY_FILE"
_MAC = b"rayfl-manifest/1\0"
_WRITE = threading.Lock()  # manifest updates of every Folder of this process
_trust = threading.local()


class Refused(UserError):
    """A file or folder rayfl will not read or write (one line)."""


def _refuse(path: Path | str, problem: str) -> Refused:
    return Refused(f"{path}: {problem}; see docs/security.md")


# ------------------------------------------------------------------------------- the key


def key_path() -> Path:
    """``$RAYFL_KEY_FILE``, else ``~/.config/rayfl/key``."""
    return Path(os.environ.get(KEY_ENV) or Path.home() / ".config" / "rayfl" / "key")


_KEYS: dict[str, bytes] = {}


def secret() -> bytes:
    """The user's 32-byte secret key, created (mode 0600) on first use.

    Raises:
        Refused: the key file is not a regular file of 32 bytes owned by this user and
            readable by this user only.
    """
    path = key_path()
    if str(path) in _KEYS:
        return _KEYS[str(path)]
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            new = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flags, 0o600)
            with os.fdopen(new, "wb") as f:
                f.write(secrets.token_bytes(32))
        fd = os.open(path, flags)
    except OSError as exc:
        raise _refuse(path, f"the key file cannot be opened ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise _refuse(path, "the key file must be yours with mode 0600 (chmod 600 it)")
        key = f.read(33)
    if len(key) != 32:
        raise _refuse(path, "the key file does not hold 32 bytes; remove it to make a new key")
    _KEYS[str(path)] = key
    return key


def _mac(body: bytes) -> bytes:
    return hmac.new(secret(), _MAC + body, hashlib.sha256).hexdigest().encode()


@contextlib.contextmanager
def untrusted() -> Iterator[None]:
    """Reads in this thread skip authentication (a colleague's folder, read-only commands);
    writes through the gate are refused meanwhile."""
    before = getattr(_trust, "off", False)
    _trust.off = True
    try:
        yield
    finally:
        _trust.off = before


def is_untrusted() -> bool:
    return bool(getattr(_trust, "off", False))


# ---------------------------------------------------------------------------- the folder


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO")):
        if test(mode):
            return name
    return "a directory" if stat.S_ISDIR(mode) else "not a regular file"


class Folder:
    """A directory held open; every name is relative to it and never followed through a link.

    The folder itself is the one the user named (a link to it is the user's choice); a
    :meth:`sub` folder is opened with ``O_NOFOLLOW`` component by component."""

    def __init__(self, path: str | Path, create: bool = False, _fd: int | None = None) -> None:
        self.path = Path(path)
        if _fd is None:
            if create:
                try:
                    self.path.mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    raise _refuse(self.path, f"cannot be created ({exc.strerror})") from None
            try:
                _fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise
            except OSError as exc:
                raise _refuse(
                    self.path, f"is not a folder rayfl can open ({exc.strerror})"
                ) from None
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
        """``file``, ``dir``, ``link``, ``other`` for what ``name`` is (never followed), or None."""
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
        """The folder ``name`` (``a/b`` walks both) inside this one; a link on the way is refused.

        Raises:
            FileNotFoundError: it is missing and ``create`` is False.
        """
        fd = self.fd
        for part in Path(name).parts:
            if part in ("..", "/"):
                raise _refuse(self.path / name, "leaves its folder")
            if create:
                self._check_writable()
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
            try:
                new = os.open(
                    part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
                )
            except FileNotFoundError:
                raise
            except OSError as exc:
                why = (
                    "is a symbolic link"
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR)
                    else exc.strerror
                )
                raise _refuse(self.path / name, f"{why}, not a folder") from None
            finally:
                if fd != self.fd:
                    os.close(fd)
            fd = new
        return Folder(self.path / name, _fd=fd if fd != self.fd else os.dup(fd))

    def tree_hashes(self, limit: int = 100_000) -> dict[str, str]:
        """``relative path -> sha256`` of every file below this folder (links, FIFOs and
        devices refused; at most ``limit`` files of at most TABLE_LIMIT bytes each)."""
        out: dict[str, str] = {}

        def walk(folder: Folder, prefix: str) -> None:
            for name in folder.names():
                kind = folder.kind(name)
                if kind == "dir":
                    with folder.sub(name) as child:
                        walk(child, f"{prefix}{name}/")
                elif kind == "file" and len(out) < limit:
                    data = folder.read_raw(name, TABLE_LIMIT)
                    out[prefix + name] = hashlib.sha256(data).hexdigest()
                else:
                    raise _refuse(folder.path / name, f"is {kind or 'gone'}, not a plain file")

        walk(self, "")
        return out

    # ------------------------------------------------------------------------- reading

    def read_raw(self, name: str, limit: int) -> bytes:
        """The bytes of the regular file ``name`` (at most ``limit``), not authenticated."""
        parent, base = self._parent(name)
        try:
            fd = os.open(
                base, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent.fd
            )
        except FileNotFoundError:
            raise
        except OSError as exc:
            why = (
                "is a symbolic link"
                if exc.errno == errno.ELOOP
                else f"cannot be read ({exc.strerror})"
            )
            raise _refuse(self.path / name, why) from None
        finally:
            if parent is not self:
                parent.close()
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _refuse(self.path / name, f"is {_kind(st.st_mode)}")
            if st.st_size > limit:
                raise _refuse(self.path / name, f"is {st.st_size} bytes, over the limit of {limit}")
            data = f.read(limit + 1)
        if len(data) > limit:
            raise _refuse(self.path / name, f"is over the limit of {limit} bytes")
        return data

    def read(self, name: str, limit: int) -> bytes:
        """The bytes of ``name``, refused unless this folder's authenticated manifest records
        their sha256 (skipped inside :func:`untrusted`)."""
        data = self.read_raw(name, limit)
        if not is_untrusted():
            allowed = self.manifest().get(name, [])
            if hashlib.sha256(data).hexdigest() not in allowed:
                raise _refuse(
                    self.path / name,
                    "was not written by your rayfl or was changed since (its folder's "
                    "authenticated manifest does not vouch for it); report and ls-runs read "
                    "others' folders with --untrusted",
                )
        return data

    def manifest(self) -> dict[str, list[str]]:
        """``name -> [sha256, ...]`` of this folder, its HMAC checked before it is parsed."""
        try:
            raw = self.read_raw(MANIFEST, TEXT_LIMIT)
        except FileNotFoundError:
            return {}
        mac, _, body = raw.partition(b"\n")
        if not hmac.compare_digest(mac, _mac(body)):
            raise _refuse(
                self.path,
                "its manifest is not authenticated by your key (written by someone else, "
                "or changed); report and ls-runs read others' folders with --untrusted",
            )
        return json.loads(body)  # type: ignore[no-any-return]

    def _save_manifest(self, entries: dict[str, list[str]]) -> None:
        body = json.dumps(entries, sort_keys=True).encode()
        self._replace(MANIFEST, _mac(body) + b"\n" + body)

    # ------------------------------------------------------------------------- writing

    def _check_writable(self) -> None:
        if is_untrusted():
            raise _refuse(self.path, "a read-only command with --untrusted writes nothing")

    def _parent(self, name: str) -> tuple[Folder, str]:
        head, _, base = name.rpartition("/")
        return (self.sub(head) if head else self), base

    def _replace(self, name: str, data: bytes) -> None:
        tmp = f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o644, dir_fd=self.fd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=self.fd)

    @contextlib.contextmanager
    def _updating(self) -> Iterator[None]:
        """Hold the manifest for one update, against this process's threads and other
        processes writing the folder (the plotting process)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        with _WRITE:
            fd = os.open(MANIFEST + ".lock", flags, 0o644, dir_fd=self.fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)

    def write(self, name: str, data: bytes, record: bool = True) -> Path:
        """Replace ``name`` (in this folder) with ``data`` atomically and, with ``record``,
        record its sha256 in the manifest: both hashes are allowed while it is replaced, so a
        crash at any moment leaves a file the manifest vouches for."""
        self._check_writable()
        if "/" in name:
            raise _refuse(self.path / name, "is not a name in this folder")
        if not record:
            self._replace(name, data)
            return self.path / name
        digest = hashlib.sha256(data).hexdigest()
        with self._updating():
            entries = self.manifest()
            entries[name] = [*entries.get(name, [])[-1:], digest]
            self._save_manifest(entries)
            self._replace(name, data)
            entries[name] = [digest]
            self._save_manifest(entries)
        return self.path / name

    def write_with(self, name: str, write: Callable[[IO[bytes]], Any]) -> Path:
        """:meth:`write` of what ``write`` writes into a buffer (a Parquet writer, savefig)."""
        buf = io.BytesIO()
        write(buf)
        return self.write(name, buf.getvalue())

    def record(self, name: str, data: bytes) -> None:
        """Record the hash of ``data`` for ``name`` written otherwise (Tune's storage)."""
        self._check_writable()
        with self._updating():
            entries = self.manifest()
            entries[name] = [hashlib.sha256(data).hexdigest()]
            self._save_manifest(entries)

    def remove(self, name: str) -> None:
        """Remove the file or (not following links) the folder tree ``name``, if there."""
        self._check_writable()
        import shutil

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
        """Where the symlink ``link`` points (a sibling name), None when there is none."""
        try:
            return os.readlink(link, dir_fd=self.fd)
        except (FileNotFoundError, OSError):
            return None

    # ------------------------------------------------------------------------- locking

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
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def owner(self) -> int | None:
        """The pid the holder wrote (best effort), or None."""
        try:
            text = self.read_raw(LOCK, 64).decode(errors="replace").strip()
        except (OSError, Refused):
            return None
        return int(text) if text.isdigit() else None


# ------------------------------------------------------------------- reading by file kind


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
    path = Path(path)
    with Folder(path.parent, create=True) as folder:
        return folder.write_with(path.name, fn)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads_json(data: bytes, path: Path | str) -> Any:
    """Strict JSON (no NaN or Infinity), else one line."""
    try:
        return json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise _refuse(path, "is not valid JSON") from None


def read_json(path: str | Path, limit: int = JSON_LIMIT) -> Any:
    return loads_json(read(path, limit), path)


def read_text(path: str | Path, limit: int = TEXT_LIMIT) -> str:
    try:
        return read(path, limit).decode("utf-8")
    except UnicodeDecodeError:
        raise _refuse(path, "is not UTF-8 text") from None


def read_table(path: str | Path, limit: int = TABLE_LIMIT) -> list[dict[str, Any]]:
    """The rows of a Parquet table ([] when missing); its row and column counts and decoded
    size are checked from its footer before any column is decoded."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        data = read(path, limit)
    except FileNotFoundError:
        return []
    try:
        meta = pq.ParquetFile(pa.BufferReader(data)).metadata
        size = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        if meta.num_rows > MAX_ROWS or meta.num_columns > MAX_COLUMNS or size > limit:
            raise _refuse(
                path,
                f"holds {meta.num_rows} rows x {meta.num_columns} columns ({size} bytes decoded), "
                f"over the limits ({MAX_ROWS} rows, {MAX_COLUMNS} columns, {limit} bytes)",
            )
        rows: list[dict[str, Any]] = pq.read_table(pa.BufferReader(data)).to_pylist()
    except (pa.ArrowException, OSError, ValueError):
        raise _refuse(path, "is not a readable Parquet table") from None
    return rows


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
