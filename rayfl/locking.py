"""Advisory file locks (``flock``) and unique temporary names.

A lock held through ``flock`` is released by the kernel when its process dies, even by SIGKILL,
so a crashed run never leaves a stale lock behind. File descriptors are opened non-inheritable
(PEP 446), so processes the holder starts (Ray's raylet, workers) do not keep the lock alive.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from collections.abc import Iterator
from pathlib import Path


def unique_suffix() -> str:
    """``<pid>-<random hex>``: a temporary name no other process or thread will pick."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:12]}"


def temp_path(path: Path) -> Path:
    """A unique sibling of ``path`` to write before ``os.replace(tmp, path)``."""
    return path.with_name(f".{path.name}.tmp-{unique_suffix()}")


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a unique temporary file, flush it to disk, then rename it over ``path``."""
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


class FileLock:
    """An exclusive ``flock`` on ``path`` (created if missing); the holder's pid is written into it.

    Example:
        >>> lock = FileLock(Path("/tmp/demo.lock"))
        >>> lock.try_acquire()
        True
        >>> lock.release()
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        """Take the lock without waiting; False when another process holds it."""
        return self._acquire(blocking=False)

    def acquire(self) -> None:
        """Wait until the lock is free, then take it."""
        self._acquire(blocking=True)

    def _acquire(self, blocking: bool) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return True

    def owner(self) -> int | None:
        """The pid written by the current holder (best effort), or None."""
        try:
            text = self.path.read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def held_by_other(self) -> bool:
        """True when some other process holds the lock right now."""
        if self._fd is not None or not self.path.exists():
            return False
        if self.try_acquire():
            self.release()
            return False
        return True

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` for the body of a ``with`` block (waits for it)."""
    lock = FileLock(path)
    lock.acquire()
    try:
        yield
    finally:
        lock.release()
