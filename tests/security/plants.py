"""Planted files for the tests that read a folder as untrusted input: a link to a victim file,
a FIFO, an oversized file and one rayfl did not write, each with the words its one-line
refusal names. The victim file (the `victim` fixture of tests/conftest.py) must stay as it was.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from rayfl.gate import JSON_LIMIT

VICTIM = b'{"precious": "data that no rayfl command may read or change"}\n'


def _symlink(path: Path, victim: Path) -> None:
    path.symlink_to(victim)


def _fifo(path: Path, victim: Path) -> None:
    os.mkfifo(path)


def _oversized(path: Path, victim: Path) -> None:
    with path.open("wb") as f:  # sparse: costs no disk
        f.truncate(JSON_LIMIT + 1)


def _planted(path: Path, victim: Path) -> None:
    path.write_text("[" * 100_000 + "]" * 100_000)  # nested deep, and not written by rayfl


PLANTS: dict[str, Callable[[Path, Path], None]] = {
    "symlink": _symlink,
    "fifo": _fifo,
    "oversized": _oversized,
    "planted": _planted,
}
PROBLEM = {
    "symlink": "symbolic link",
    "fifo": "FIFO",
    "oversized": "over the limit",
    "planted": "not written by your rayfl",
}


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]
