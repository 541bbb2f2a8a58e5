"""Advisory file locks (``flock``) on files that are never followed through a symlink.

A lock held through ``flock`` is released by the kernel when its process dies, even by SIGKILL,
so a crashed run never leaves a stale lock behind. File descriptors are opened non-inheritable
(PEP 446), so processes the holder starts (Ray's raylet, workers) do not keep the lock alive.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from rayfl.safefile import UnsafeFile, read_bytes


def _open_lock(path: Path, flags: int) -> int:
    """Open the lock file without following a symlink; refuse anything but a regular file with
    one link (a hard link to a victim file would otherwise be truncated by the holder)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFile(
                f"{path}: is a symbolic link; rayfl never writes through links in a run "
                "directory (see docs/security.md): remove it or use another directory"
            ) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise UnsafeFile(
            f"{path}: is not a plain lock file (a FIFO, device or hard link); remove it or "
            "use another directory (see docs/security.md)"
        )
    return fd


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
        fd = _open_lock(self.path, os.O_RDWR | os.O_CREAT)
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
            text = read_bytes(self.path, 64).decode(errors="replace").strip()
        except (OSError, UnsafeFile):
            return None
        return int(text) if text.isdigit() else None

    def held_by_other(self) -> bool:
        """True when some other process holds the lock right now. Only looks: the file is
        opened read-only and never created or written (`rayfl ls-runs` changes no lock)."""
        if self._fd is not None:
            return False
        try:
            fd = _open_lock(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

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
