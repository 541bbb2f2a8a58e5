"""Reading and writing files in run and suite directories, which rayfl does not trust.

A run directory may sit on a shared filesystem, be copied from elsewhere or be changed by
another user (see docs/security.md). Every file rayfl reads there goes through :func:`read_bytes`
(or :func:`read_json`, :func:`read_text`, :func:`open_npz`): opened with ``O_NOFOLLOW`` and
``O_NONBLOCK`` (a symlink or a FIFO is refused instead of followed or waited on), checked to be
a regular file, and its size checked against a limit before a byte is read. Every file rayfl
writes there goes through :func:`write_atomic`: a new temporary file created with ``O_EXCL`` and
renamed over the target, so a symlink planted at the target is replaced, never written through.
Each refusal is a :class:`UnsafeFile`, a :class:`~rayfl.errors.UserError` of one line.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import stat
import uuid
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from rayfl.errors import UserError

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
# JSON files of a run (summary, manifest, history, mlflow_run): far below this even with
# thousands of rounds or clients; a bigger one was not written by rayfl.
JSON_LIMIT = 64 * MIB
JSON_DEPTH = 32  # rayfl's own JSON nests at most ~8 deep (summary -> config -> engine -> ...)
TEXT_LIMIT = 16 * MIB  # config.yaml, table.txt
TABLE_LIMIT = 1 * GIB  # Parquet tables (metrics, partition of 10^8 samples)
STATE_LIMIT = 16 * GIB  # one checkpoint state file (.npz)

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafeFile(UserError):
    """A file in a run or suite directory that rayfl refuses to read or write (one line)."""


def unique_suffix() -> str:
    """``<pid>-<random hex>``: a temporary name no other process or thread will pick."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:12]}"


def temp_path(path: Path) -> Path:
    """A unique sibling of ``path`` to write before ``os.replace(tmp, path)``."""
    return path.with_name(f".{path.name}.tmp-{unique_suffix()}")


def _refuse(path: Path, problem: str) -> UnsafeFile:
    return UnsafeFile(
        f"{path}: {problem}; rayfl reads and writes only regular files of sane size in a run "
        "directory (see docs/security.md): remove it or use another directory"
    )


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def lstat(path: Path) -> os.stat_result | None:
    """``os.lstat`` of ``path``, or None when nothing is there."""
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _refuse(path, f"cannot be inspected ({exc.strerror})") from None


def is_file(path: Path) -> bool:
    """True for a regular file, False for nothing there; refuses anything else (a symlink too)."""
    st = lstat(path)
    if st is None:
        return False
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, f"is {_kind(st.st_mode)}")
    return True


def real_dir(path: Path, inside: Path | None = None) -> Path:
    """``path`` if it is a real directory (not a symlink to one) and, with ``inside``, directly
    or deeper within ``inside``.

    Raises:
        UnsafeFile: it is missing, a symlink, another kind of file, or outside ``inside``.
    """
    st = lstat(path)
    if st is None:
        raise _refuse(path, "is missing")
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, f"is {_kind(st.st_mode)}, not a directory")
    if inside is not None:
        resolved, base = Path(os.path.realpath(path)), Path(os.path.realpath(inside))
        if resolved != base and base not in resolved.parents:
            raise _refuse(path, f"is outside {inside}")
    return path


@contextlib.contextmanager
def open_regular(path: Path, limit: int) -> Iterator[IO[bytes]]:
    """A binary file object for the regular file ``path`` of at most ``limit`` bytes.

    Raises:
        UnsafeFile: a symlink, FIFO, device or directory; over ``limit``; unreadable.
    """
    try:
        fd = os.open(path, _READ_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse(path, "is a symbolic link") from None
        raise _refuse(path, f"cannot be opened ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, f"is {_kind(st.st_mode)}")
        if st.st_size > limit:
            raise _refuse(path, f"is {st.st_size} bytes, over the limit of {limit}")
        os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


def read_bytes(path: Path, limit: int) -> bytes:
    """The content of the regular file ``path``, refused beyond ``limit`` bytes (see
    :func:`open_regular`); FileNotFoundError when it is missing."""
    with open_regular(path, limit) as f:
        data = f.read(limit + 1)
    if len(data) > limit:  # it grew while being read
        raise _refuse(path, f"is over the limit of {limit} bytes")
    return data


def read_text(path: Path, limit: int = TEXT_LIMIT) -> str:
    """:func:`read_bytes` decoded as UTF-8 (a file that is not is refused)."""
    try:
        return read_bytes(path, limit).decode("utf-8")
    except UnicodeDecodeError:
        raise _refuse(path, "is not UTF-8 text") from None


def json_depth(data: bytes) -> int:
    """How deeply arrays and objects nest in the JSON text ``data`` (brackets inside strings
    are not counted). Linear in the size, in numpy, before any parser recurses."""
    raw = np.frombuffer(data, dtype=np.uint8)
    if raw.size == 0:
        return 0
    quote = raw == ord('"')
    if quote.any():
        # a quote preceded by an odd run of backslashes is escaped
        backslash = (raw == ord("\\")).astype(np.int64)
        run = np.zeros(raw.size, dtype=np.int64)
        # length of the run of backslashes ending just before each position
        idx = np.arange(raw.size)
        last_other = np.maximum.accumulate(np.where(backslash == 0, idx, -1))
        run[1:] = idx[:-1] - last_other[:-1]
        quote &= (run % 2) == 0
    inside = (np.cumsum(quote) - quote) % 2 == 1  # between an opening and a closing quote
    opens = np.isin(raw, (ord("["), ord("{"))) & ~inside
    closes = np.isin(raw, (ord("]"), ord("}"))) & ~inside
    depth = np.cumsum(opens.astype(np.int64) - closes.astype(np.int64))
    return int(depth.max(initial=0))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads_json(data: bytes, path: Path, depth: int = JSON_DEPTH) -> Any:
    """Strict JSON (no NaN or Infinity) nested at most ``depth`` deep, else one line."""
    if json_depth(data) > depth:
        raise _refuse(path, f"nests deeper than {depth} levels")
    try:
        return json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise _refuse(path, "is not valid JSON (truncated or changed)") from None


def read_json(path: Path, limit: int = JSON_LIMIT, depth: int = JSON_DEPTH) -> Any:
    """A JSON file of a run directory, read with :func:`read_bytes` and :func:`loads_json`."""
    return loads_json(read_bytes(path, limit), path, depth)


def read_table(path: Path, limit: int = TABLE_LIMIT) -> list[dict[str, Any]]:
    """The rows of a Parquet table (empty when the file is missing), read from memory."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        data = read_bytes(path, limit)
    except FileNotFoundError:
        return []
    try:
        rows: list[dict[str, Any]] = pq.read_table(pa.BufferReader(data)).to_pylist()
    except (pa.ArrowException, OSError, ValueError):
        raise _refuse(path, "is not a readable Parquet table") from None
    return rows


def check_npz(data: bytes, path: Path) -> None:
    """Refuse an ``.npz`` archive (held in ``data``) that is compressed, holds Python objects,
    or has an array whose header declares other than the bytes its member holds (an array
    declared as 2 GiB in a 2 MB file), before anything is allocated for it."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            for info in archive.infolist():
                # rayfl writes states uncompressed (np.savez): a member holds what it declares
                if info.compress_type != zipfile.ZIP_STORED or info.file_size > len(data):
                    raise _refuse(path, f"member {info.filename} is compressed or oversized")
                with archive.open(info) as member:
                    version = np.lib.format.read_magic(member)
                    header = (
                        np.lib.format.read_array_header_1_0
                        if version == (1, 0)
                        else np.lib.format.read_array_header_2_0
                    )
                    shape, _, dtype = header(member, max_header_size=10_000)
                    start = member.tell()
                if dtype.hasobject:
                    raise _refuse(path, f"member {info.filename} holds Python objects")
                need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                if need != info.file_size - start:
                    raise _refuse(
                        path,
                        f"member {info.filename} declares {need} bytes of data but holds "
                        f"{info.file_size - start}",
                    )
    except UnsafeFile:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, OverflowError):
        raise _refuse(path, "is not a readable .npz archive") from None


def open_npz(data: bytes, path: Path) -> Any:
    """The ``.npz`` archive held in ``data`` once :func:`check_npz` passed it; never unpickles
    (``allow_pickle=False``)."""
    check_npz(data, path)
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError):
        raise _refuse(path, "is not a readable .npz archive") from None


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a new temporary sibling (``O_EXCL | O_NOFOLLOW``), fsync it, then
    rename it over ``path``: a reader never sees half a file, and a symlink at ``path`` is
    replaced, not written through."""
    tmp = temp_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_with(path: Path, write: Callable[[IO[bytes]], Any]) -> Path:
    """:func:`write_atomic` of what ``write`` writes into a binary buffer (a Parquet writer,
    matplotlib's ``savefig``); returns ``path``."""
    buf = io.BytesIO()
    write(buf)
    write_atomic(path, buf.getvalue())
    return path
