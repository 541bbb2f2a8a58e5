"""The run directory as the unit of durability: checked before any work, locked while a run owns
it, strict JSON inside, and listed by `rayfl ls-runs`.

Files a run keeps there: ``config.yaml``, ``summary.json`` (status RUNNING until the run ends),
``metrics.parquet``, ``checkpoint`` (see :mod:`rayfl.engine.checkpoint`), ``mlflow_run.json`` (the
MLflow run a resume continues) and ``.lock`` (held with ``flock`` by the process running it).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayfl.errors import UserError
from rayfl.locking import FileLock, temp_path, write_atomic

LOCK = ".lock"
MLFLOW_RUN = "mlflow_run.json"


def finite_or_none(obj: Any) -> Any:
    """A copy of nested dicts/lists with NaN and inf floats replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite_or_none(v) for v in obj]
    return obj


def strict_json(obj: Any, **kwargs: Any) -> str:
    """JSON that every parser accepts: NaN and inf become null (`allow_nan=False` holds)."""
    return json.dumps(finite_or_none(obj), allow_nan=False, default=str, **kwargs)


def check_writable(run_dir: Path) -> None:
    """Create ``run_dir`` (and parents) and prove a file can be written there.

    Raises:
        UserError: it cannot be created or written (one line, naming the path and the fix).
    """
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--out {run_dir}: exists and is not a directory; choose another path")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = temp_path(run_dir / "write-test")
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise UserError(
            f"--out {run_dir}: cannot write there ({reason}); choose a writable directory"
        ) from None


class RunLock:
    """The exclusive lock a run holds on its directory for as long as it runs."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self._lock = FileLock(self.run_dir / LOCK)

    def acquire(self) -> None:
        """Raises:
        UserError: another process holds the directory (the message names its pid)."""
        if not self._lock.try_acquire():
            pid = self._lock.owner()
            raise UserError(
                f"run directory {self.run_dir} is in use by another rayfl run (pid {pid}); "
                "wait for it to finish or choose another --out"
            )

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def read_mlflow_run(run_dir: Path) -> dict[str, str] | None:
    """The MLflow run this directory logs to (``run_id``, ``tracking_uri``), if any."""
    path = Path(run_dir) / MLFLOW_RUN
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("run_id"), str):
        return None
    return {k: str(v) for k, v in data.items()}


def write_mlflow_run(run_dir: Path, run_id: str, tracking_uri: str) -> None:
    write_atomic(
        Path(run_dir) / MLFLOW_RUN,
        strict_json({"run_id": run_id, "tracking_uri": tracking_uri}).encode(),
    )


@dataclass
class RunInfo:
    path: Path
    status: str
    rounds: int
    metric: float | None
    owner: int | None = None


def run_info(run_dir: Path, mark_killed: bool = True) -> RunInfo:
    """Status of one run directory. A directory whose summary says RUNNING but whose lock nobody
    holds was killed: with ``mark_killed`` its summary and its MLflow run are marked KILLED."""
    lock = FileLock(run_dir / LOCK)
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {}
    if not isinstance(summary, dict):
        summary = {}
    final = summary.get("final") if isinstance(summary.get("final"), dict) else {}
    metric = final.get("personal/acc") if isinstance(final, dict) else None
    rounds = int(summary.get("rounds") or 0)
    status = str(summary.get("status") or "KILLED")
    if lock.held_by_other():
        return RunInfo(run_dir, "RUNNING", rounds, metric, lock.owner())
    if status == "RUNNING" or not summary:
        status = "KILLED"
        if mark_killed:
            if summary:
                summary["status"] = "KILLED"
                write_atomic(run_dir / "summary.json", strict_json(summary, indent=2).encode())
            mark_mlflow_killed(run_dir)
    return RunInfo(run_dir, status, rounds, metric if isinstance(metric, float) else None)


def mark_mlflow_killed(run_dir: Path) -> bool:
    """Set the directory's MLflow run to KILLED if it is still RUNNING; True when it was."""
    ref = read_mlflow_run(run_dir)
    if ref is None:
        return False
    from rayfl.tracking.mlflow import mark_killed

    return mark_killed(ref["run_id"], ref.get("tracking_uri"))


def list_runs(root: Path, max_depth: int = 4) -> list[RunInfo]:
    """Every run directory (a directory with a config.yaml) at ``root`` or below it, down to
    ``max_depth`` levels: a suite folder holds its runs as ``[setting/]label/seedN``. Symbolic
    links are not followed and a run directory's own folders (checkpoints) are not searched."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"{root} is not a directory; pass the folder holding run directories")
    found: list[Path] = []

    def walk(folder: Path, depth: int) -> None:
        if (folder / "config.yaml").is_file():
            found.append(folder)
            return
        if depth >= max_depth:
            return
        try:
            children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.is_symlink())
        except OSError:  # unreadable folder: list what can be read
            return
        for child in children:
            walk(child, depth + 1)

    walk(root, 0)
    return [run_info(p) for p in found]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
