"""The run directory as the unit of durability: checked before any work, locked while a run owns
it, strict JSON inside, and listed by `rayfl ls-runs`.

Files a run keeps there: ``config.yaml``, ``summary.json`` (status RUNNING until the run ends),
``metrics.parquet``, ``checkpoint`` (see :mod:`rayfl.engine.checkpoint`), ``mlflow_run.json`` (the
MLflow run a resume continues) and ``.lock`` (held with ``flock`` by the process running it).

A run directory is untrusted input (docs/security.md): :func:`check_run_dir` refuses one that
holds links, FIFOs or devices before any command reads it, and every file is read and written
through :mod:`rayfl.safefile`.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rayfl.errors import UserError
from rayfl.locking import FileLock
from rayfl.safefile import (
    UnsafeFile,
    lstat,
    read_json,
    temp_path,
    write_atomic,
)
from rayfl.tables import strict_json

if TYPE_CHECKING:
    from rayfl.schema import RunConfig

log = logging.getLogger(__name__)

LOCK = ".lock"
MLFLOW_RUN = "mlflow_run.json"
SUMMARY = "summary.json"
CHECKPOINT_LINK = "checkpoint"
# checkpoint folders (`checkpoint.r00003-<pid>-<hex>`, `checkpoint.legacy-<pid>-<hex>`) and the
# temporary link a crash between its creation and its rename can leave behind
CHECKPOINT_FOLDER = re.compile(r"^checkpoint\.(r\d{5,}|legacy)-[0-9]+-[0-9a-f]+$")
_STALE_LINK = re.compile(r"^\.checkpoint\.link-[0-9]+-[0-9a-f]+$")


def _refuse_entry(path: Path, mode: int) -> UnsafeFile:
    kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file or directory"
    return UnsafeFile(
        f"{path}: is {kind}; rayfl does not follow links or read special files in a run "
        "directory (see docs/security.md): remove it, or copy the run directory without it"
    )


def check_run_dir(run_dir: Path) -> None:
    """Refuse a run directory that holds anything but regular files and real directories: a
    symlink (other than the ``checkpoint`` link, which :mod:`rayfl.engine.checkpoint` checks),
    a FIFO, a device or a socket, at its top level or in its checkpoint folders.

    Raises:
        UnsafeFile: one line naming the first such entry.
    """
    run_dir = Path(run_dir)  # named by the user (a link to it is theirs); its entries are not
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: not a directory; pass a run directory written by rayfl run")
    with os.scandir(run_dir) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            mode = entry.stat(follow_symlinks=False).st_mode
            path = run_dir / entry.name
            if stat.S_ISLNK(mode) and (
                entry.name == CHECKPOINT_LINK or _STALE_LINK.match(entry.name)
            ):
                continue
            if stat.S_ISDIR(mode) and CHECKPOINT_FOLDER.match(entry.name):
                _check_tree(path, depth=2)
            elif not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise _refuse_entry(path, mode)


def _check_tree(folder: Path, depth: int) -> None:
    with os.scandir(folder) as entries:
        for entry in entries:
            mode = entry.stat(follow_symlinks=False).st_mode
            if stat.S_ISDIR(mode) and depth > 1:
                _check_tree(folder / entry.name, depth - 1)
            elif not stat.S_ISREG(mode):
                raise _refuse_entry(folder / entry.name, mode)


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
        write_atomic(probe, b"")
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
    """The MLflow run this directory logs to (``run_id``, ``tracking_uri``), if any.

    Raises:
        UnsafeFile: the file is a link, a FIFO, oversized or nested too deep.
    """
    path = Path(run_dir) / MLFLOW_RUN
    try:
        data = read_json(path, limit=64 * 1024)
    except FileNotFoundError:
        return None
    except UnsafeFile as exc:
        if "not valid JSON" in str(exc):  # torn by a crash: there is nothing to continue
            return None
        raise
    if not isinstance(data, dict) or not isinstance(data.get("run_id"), str):
        return None
    return {k: str(v) for k, v in data.items() if isinstance(v, str)}


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


def read_summary(run_dir: Path) -> dict[str, Any]:
    """``summary.json`` of a run directory ({} when missing or torn by a crash), its fields
    checked: ``rounds`` a count, ``status`` and ``name`` strings, ``final`` and ``config``
    objects, ``final`` values numbers or null.

    Raises:
        UnsafeFile: a link, FIFO, oversized or deeply nested file, or malformed fields.
    """
    path = Path(run_dir) / SUMMARY
    try:
        summary = read_json(path)
    except FileNotFoundError:
        return {}
    except UnsafeFile as exc:
        if "not valid JSON" in str(exc):  # torn by a crash before writes were atomic
            return {}
        raise
    problem = _summary_problem(summary)
    if problem:
        raise UnsafeFile(
            f"{path}: {problem}; it was not written by rayfl (or was changed since): "
            "remove the run directory or restore the file"
        )
    return summary  # type: ignore[no-any-return]


def _summary_problem(summary: Any) -> str:
    if not isinstance(summary, dict):
        return "is not a JSON object"
    rounds = summary.get("rounds", 0)
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        return f"'rounds' is {rounds!r}, not a count"
    for key in ("status", "name"):
        if not isinstance(summary.get(key, ""), str):
            return f"{key!r} is not a string"
    for key in ("seed", "wall_s"):
        value = summary.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            return f"{key!r} is not a number"
    for key in ("final", "config"):
        if not isinstance(summary.get(key, {}), dict):
            return f"{key!r} is not an object"
    for key, value in summary.get("final", {}).items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            return f"final[{key!r}] is not a number"
    return ""


def run_info(run_dir: Path, mark_killed: bool = True) -> RunInfo:
    """Status of one run directory. A directory whose summary says RUNNING but whose lock nobody
    holds was killed: with ``mark_killed`` its summary and its MLflow run are marked KILLED.

    Raises:
        UnsafeFile: the directory holds links or special files, or a malformed summary.
    """
    check_run_dir(run_dir)
    lock = FileLock(run_dir / LOCK)
    summary = read_summary(run_dir)
    final = summary.get("final", {})
    metric = final.get("personal/acc")
    rounds = int(summary.get("rounds") or 0)
    status = str(summary.get("status") or "KILLED")
    if lock.held_by_other():
        return RunInfo(run_dir, "RUNNING", rounds, metric, lock.owner())
    if status == "RUNNING" or not summary:
        status = "KILLED"
        if mark_killed:
            if summary:
                summary["status"] = "KILLED"
                write_atomic(run_dir / SUMMARY, strict_json(summary, indent=2).encode())
            mark_mlflow_killed(run_dir)
    return RunInfo(run_dir, status, rounds, metric if isinstance(metric, float) else None)


def mark_mlflow_killed(run_dir: Path) -> bool:
    """Set the directory's MLflow run to KILLED if it is still RUNNING; True when it was.

    Only in the tracking store this user's environment names (``$MLFLOW_TRACKING_URI`` or the
    default): a URI read from a run directory is never contacted or created on its own word."""
    ref = read_mlflow_run(run_dir)
    if ref is None:
        return False
    from rayfl.tracking.base import default_tracking_uri
    from rayfl.tracking.mlflow import mark_killed

    uri = default_tracking_uri()
    if (ref.get("tracking_uri") or uri) != uri:
        log.info(
            "%s: its MLflow run is in %s, not in this environment's store %s; not marked KILLED",
            run_dir,
            ref.get("tracking_uri"),
            uri,
        )
        return False
    return mark_killed(ref["run_id"], uri)


def list_runs(root: Path, max_depth: int = 4) -> list[RunInfo]:
    """Every run directory (a real directory with a config.yaml) at ``root`` or below it, down
    to ``max_depth`` levels: a suite folder holds its runs as ``[setting/]label/seedN``. Links
    are not followed and a run directory's own folders (checkpoints) are not searched."""
    root = Path(root)
    if not root.is_dir():
        raise UserError(f"{root} is not a directory; pass the folder holding run directories")
    found: list[Path] = []

    def walk(folder: Path, depth: int) -> None:
        if lstat(folder / "config.yaml") is not None:
            found.append(folder)
            return
        if depth >= max_depth:
            return
        try:
            children = sorted(folder.iterdir())
        except OSError:  # unreadable folder: list what can be read
            return
        for child in children:
            st = lstat(child)
            if st is not None and stat.S_ISDIR(st.st_mode):
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


# Settings that name a place outside the run: a resume takes them from the command line only.
UNTRUSTED_KEYS = ("data.root", "tracking.uri", "engine.address", "engine.spill_dir")


def resume_config(run_dir: Path, overrides: list[str]) -> RunConfig:
    """The config to resume ``run_dir`` with, checked before anything starts (no Ray, no data).

    The directory is untrusted (docs/security.md): it must hold only regular files and real
    folders (:func:`check_run_dir`) and no other process may hold it; its ``config.yaml`` is read
    bounded, and any path or address in it (:data:`UNTRUSTED_KEYS`) must be repeated on the
    command line, as must the tracking URI of its ``mlflow_run.json``.

    Raises:
        UserError: one line naming the problem and the fix.
    """
    from rayfl.config import build_config, parse_yaml
    from rayfl.safefile import read_text

    check_run_dir(run_dir)
    if FileLock(run_dir / LOCK).held_by_other():
        raise UserError(
            f"run directory {run_dir} is in use by another rayfl run; wait for it to finish"
        )
    path = run_dir / "config.yaml"
    try:
        raw = parse_yaml(read_text(path), path)
    except FileNotFoundError:
        raise UserError(
            f"--resume {run_dir}: no config.yaml there; pass a run directory written by rayfl run"
        ) from None
    read_summary(run_dir)
    from rayfl import plugins

    if plugins.KEY in raw:  # importing them would run the directory's code
        raise UserError(
            f"--resume {run_dir}: its config.yaml names plugins to import; a resume takes them "
            "from your command line only: pass them with --plugin"
        )
    given = {o.split("=", 1)[0].strip(): o.split("=", 1)[1].strip() for o in overrides}
    for key in UNTRUSTED_KEYS:
        section, name = key.split(".")
        value = raw.get(section, {}).get(name) if isinstance(raw.get(section), dict) else None
        if value is not None and key not in given:
            raise UserError(
                f"--resume {run_dir}: its config.yaml sets {key} to {value!r}; a resume takes "
                f"paths and addresses from your command line only: add {key}={value} if you "
                "trust it"
            )
    cfg = build_config(raw, overrides)
    ref = read_mlflow_run(run_dir)
    if ref is not None and cfg.tracking.backend == "mlflow" and ref.get("tracking_uri"):
        from rayfl.tracking.base import default_tracking_uri

        mine = cfg.tracking.uri or default_tracking_uri()
        if ref["tracking_uri"] != mine:
            raise UserError(
                f"--resume {run_dir}: its MLflow run is in {ref['tracking_uri']}, not in "
                f"{mine}; add tracking.uri={ref['tracking_uri']} if you trust it, or remove "
                f"{run_dir / MLFLOW_RUN} to log to a new MLflow run"
            )
    return cfg
