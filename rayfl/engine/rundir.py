"""The run directory as the unit of durability: locked while a run owns it, strict JSON inside,
and listed by `rayfl ls-runs`.

Files a run keeps there: ``config.yaml``, ``summary.json`` (status RUNNING until the run ends),
``metrics.parquet``, ``checkpoint`` (see :mod:`rayfl.engine.checkpoint`), ``mlflow_run.json`` (the
MLflow run a resume continues). Every file is read and written through :mod:`rayfl.gate`: what
is read back must be what this user's rayfl wrote (docs/security.md).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rayfl import gate
from rayfl.errors import UserError
from rayfl.tables import strict_json

if TYPE_CHECKING:
    from rayfl.schema import RunConfig

log = logging.getLogger(__name__)

MLFLOW_RUN = "mlflow_run.json"
SUMMARY = "summary.json"


def check_writable(run_dir: Path) -> None:
    """Create ``run_dir`` (and parents) and prove a file can be written there.

    Raises:
        UserError: it cannot be created or written (one line, naming the path and the fix).
    """
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--out {run_dir}: exists and is not a directory; choose another path")
    try:
        with gate.Folder(run_dir, create=True) as folder:
            folder.write(".write-test", b"", record=False)
            folder.remove(".write-test")
    except (OSError, gate.Refused) as exc:
        reason = getattr(exc, "strerror", None) or type(exc).__name__
        raise UserError(
            f"--out {run_dir}: cannot write there ({reason}); choose a writable directory"
        ) from None


def is_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a run (a summary or a manifest rayfl wrote)."""
    try:
        with gate.Folder(run_dir) as folder:
            return any(folder.kind(n) for n in (SUMMARY, gate.MANIFEST))
    except (FileNotFoundError, gate.Refused):
        return False


def archive(run_dir: Path) -> Path:
    """Move the run in ``run_dir`` aside to ``<run_dir>.archived-<time>`` (``--force``)."""
    run_dir = Path(run_dir)
    aside = run_dir.with_name(f"{run_dir.name}.archived-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        os.rename(run_dir, aside)  # never onto an existing folder (a second --force this second)
    except OSError as exc:
        raise UserError(f"--force: cannot move {run_dir} to {aside} ({exc.strerror})") from None
    log.warning("the earlier run in %s was moved to %s", run_dir, aside)
    return aside


class RunLock:
    """The exclusive lock a run holds on its directory for as long as it runs."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self._folder: gate.Folder | None = None

    def acquire(self) -> None:
        """Raises:
        UserError: another process holds the directory (the message names its pid)."""
        folder = gate.Folder(self.run_dir, create=True)
        if not folder.lock():
            pid = folder.owner()
            folder.close()
            raise UserError(
                f"run directory {self.run_dir} is in use by another rayfl run (pid {pid}); "
                "wait for it to finish or choose another --out"
            )
        self._folder = folder

    def release(self) -> None:
        if self._folder is not None:
            self._folder.unlock()
            self._folder.close()
            self._folder = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def read_mlflow_run(run_dir: Path) -> dict[str, str] | None:
    """The MLflow run this directory logs to (``run_id``, ``tracking_uri``), if any; read
    through the gate, so only one this user's rayfl recorded."""
    try:
        data = gate.read_json(Path(run_dir) / MLFLOW_RUN, limit=64 * 1024)
    except FileNotFoundError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("run_id"), str):
        return None
    return {k: str(v) for k, v in data.items() if isinstance(v, str)}


def write_mlflow_run(run_dir: Path, run_id: str, tracking_uri: str) -> None:
    gate.write(
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
    """``summary.json`` of a run directory ({} when missing), read through the gate."""
    try:
        summary = gate.read_json(Path(run_dir) / SUMMARY)
    except FileNotFoundError:
        return {}
    if not isinstance(summary, dict):
        raise UserError(f"{Path(run_dir) / SUMMARY}: not a JSON object")
    return summary


def run_info(run_dir: Path, mark_killed: bool = True) -> RunInfo:
    """Status of one run directory. A directory whose summary says RUNNING but whose lock nobody
    holds was killed: with ``mark_killed`` (never for a folder read with ``--untrusted``) its
    summary and its MLflow run are marked KILLED."""
    with gate.Folder(run_dir) as folder:
        held, owner = folder.held(), folder.owner()
    summary = read_summary(run_dir)
    final = summary.get("final")
    metric = final.get("personal/acc") if isinstance(final, dict) else None
    metric = metric if isinstance(metric, float) else None
    rounds = summary.get("rounds")
    rounds = rounds if isinstance(rounds, int) else 0
    status = str(summary.get("status") or "KILLED")[:20]
    if held:
        return RunInfo(run_dir, "RUNNING", rounds, metric, owner)
    if status == "RUNNING" or not summary:
        status = "KILLED"
        if mark_killed and not gate.is_untrusted():
            if summary:
                summary["status"] = "KILLED"
                gate.write(run_dir / SUMMARY, strict_json(summary, indent=2).encode())
            mark_mlflow_killed(run_dir)
    return RunInfo(run_dir, status, rounds, metric)


def mark_mlflow_killed(run_dir: Path) -> bool:
    """Set the directory's MLflow run to KILLED if it is still RUNNING; True when it was.

    Only in the store this user's environment names (``$MLFLOW_TRACKING_URI`` or the default),
    only when the directory recorded that store, and never creating a store that is not there."""
    ref = read_mlflow_run(run_dir)
    if ref is None:
        return False
    from rayfl.tracking.base import default_tracking_uri
    from rayfl.tracking.mlflow import mark_killed

    uri = default_tracking_uri()
    if ref.get("tracking_uri") != uri:
        log.info("%s: its MLflow run is not in this environment's store %s", run_dir, uri)
        return False
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).is_file():
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

    def walk(folder: gate.Folder, depth: int) -> None:
        if folder.kind("config.yaml") is not None:
            found.append(folder.path)
            return
        if depth >= max_depth:
            return
        for name in folder.names():
            if folder.kind(name) == "dir":
                with folder.sub(name) as child:
                    walk(child, depth + 1)

    with gate.Folder(root) as top:
        walk(top, 0)
    return [run_info(p) for p in found]


def resume_config(run_dir: Path, overrides: list[str]) -> RunConfig:
    """The config to resume ``run_dir`` with, checked before anything starts (no Ray, no data):
    its ``config.yaml`` and ``mlflow_run.json`` come through the gate, and the MLflow run it
    recorded must be in the store the user's config or environment names.

    Raises:
        UserError: one line naming the problem and the fix.
    """
    from rayfl.config import build_config, parse_yaml

    with gate.Folder(run_dir) as folder:
        if folder.held():
            raise UserError(
                f"run directory {run_dir} is in use by another rayfl run; wait for it to finish"
            )
    path = run_dir / "config.yaml"
    try:
        raw = parse_yaml(gate.read_text(path), path)
    except FileNotFoundError:
        raise UserError(
            f"--resume {run_dir}: no config.yaml there; pass a run directory written by rayfl run"
        ) from None
    read_summary(run_dir)  # every file a resume may read is what this user's rayfl wrote
    from rayfl import plugins

    if plugins.KEY in raw:  # importing them would run code named by the directory
        raise UserError(
            f"--resume {run_dir}: its config.yaml names plugins to import; a resume takes them "
            "from your command line only: pass them with --plugin"
        )
    cfg = build_config(raw, overrides)
    check_mlflow_ref(run_dir, cfg)
    return cfg


def check_mlflow_ref(run_dir: Path, cfg: RunConfig) -> dict[str, str] | None:
    """The MLflow run ``run_dir`` recorded, if a resume may continue it: it must be in the
    store the user's config or environment names.

    Raises:
        UserError: it is recorded in another store (one line with the fix).
    """
    ref = read_mlflow_run(run_dir)
    if ref is None or cfg.tracking.backend != "mlflow":
        return None
    from rayfl.tracking.base import default_tracking_uri

    mine = cfg.tracking.uri or default_tracking_uri()
    if ref.get("tracking_uri") != mine:
        raise UserError(
            f"--resume {run_dir}: its MLflow run is in {ref.get('tracking_uri') or 'no named store'}"
            f", not in {mine}; add tracking.uri=... naming that store if you trust it, or remove "
            f"{Path(run_dir) / MLFLOW_RUN} to log to a new MLflow run"
        )
    return ref


def runs_table(runs: list[RunInfo]) -> str:
    """`rayfl ls-runs`: one line per run directory (path, status, rounds, personal/acc)."""
    width = max(len(str(r.path)) for r in runs)
    lines = [f"{'run directory'.ljust(width)}  {'status':8s}  rounds  personal/acc"]
    for r in runs:
        metric = "-" if r.metric is None else f"{r.metric:.4f}"
        status = r.status if r.owner is None else f"{r.status} (pid {r.owner})"
        lines.append(f"{str(r.path).ljust(width)}  {status:8s}  {r.rounds:6d}  {metric}")
    return "\n".join(lines)
