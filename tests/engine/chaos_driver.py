"""`python -m tests.engine.chaos_driver ARGS...`: `rayfl ARGS...`, except that with
RAYFL_CHAOS_KILL_AT_WRITE=k the process SIGKILLs itself halfway through the k-th checkpoint file
it writes (a driver killed inside a checkpoint write, at a chosen point)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path


def _install_write_hook(k: int) -> None:
    from rayfl.engine import checkpoint

    real = checkpoint.write_file
    calls = {"n": 0}

    def write_file(path: Path, data: bytes) -> None:
        calls["n"] += 1
        if calls["n"] == k:
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        real(path, data)

    checkpoint.write_file = write_file  # type: ignore[assignment]


if __name__ == "__main__":
    kill_at = int(os.environ.get("RAYFL_CHAOS_KILL_AT_WRITE", "0"))
    if kill_at:
        _install_write_hook(kill_at)
    from rayfl.cli import main

    sys.exit(main(sys.argv[1:]))
