"""Building and running one simulation from a config: the one road that `rayfl run`, suites,
sweeps and benchmarks take. The CLI only parses arguments and prints what this returns.

Ray and the engine are imported inside the functions that need them, so importing this module
(as `rayfl validate` does) starts and imports nothing heavy.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

from rayfl.schema import RunConfig


def default_run_dir(cfg: RunConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{cfg.name}-{cfg.algorithm.name}-s{cfg.seed}-{stamp}"


def simulate(
    cfg: RunConfig,
    run_dir: str | Path,
    *,
    progress: bool = True,
    resume: bool = False,
    parent_run_id: str | None = None,
    extra_callbacks: Sequence[Any] = (),
    existing: str = "refuse",
) -> Any:
    """Run one simulation with the standard callbacks (run directory, checkpoints, tracker, progress).

    Before any data is loaded or Ray started: a private Ray's workers are checked to fit this
    machine (a GPU asked of a machine without one), the run directory is created and checked
    writable, locked for this process (a second run on it stops with one line) and, for a
    resume, its checkpoint is verified. A resume continues the MLflow run recorded in the
    directory. `existing`: what a new run does with a run already in `run_dir`: `refuse` (one
    line), `archive` (moved aside, `--force`) or `replace` (a suite's or sweep's own rerun).
    """
    import ray

    from rayfl.engine.checkpoint import Checkpoint
    from rayfl.engine.rundir import RunLock, archive, check_mlflow_ref, check_writable, is_run
    from rayfl.errors import UserError
    from rayfl.resources import check_local

    if cfg.engine.executor == "ray" and not ray.is_initialized():
        check_local(cfg.engine)  # a private Ray: what this machine cannot place, refused first
    run_dir = Path(run_dir)
    created = not os.path.lexists(run_dir)
    try:
        if not resume and existing != "replace" and is_run(run_dir):
            if existing != "archive":
                raise UserError(
                    f"--out {run_dir}: holds a run already; choose another --out, continue it "
                    "with --resume, or pass --force to move it aside first"
                )
            archive(run_dir)
        check_writable(run_dir)
        with RunLock(run_dir):
            checkpoint = Checkpoint(run_dir, cfg.engine.checkpoint_every, resume=resume, cfg=cfg)
            if resume:  # every resume (CLI, Python API, a suite's runs) goes through the gate
                check_mlflow_ref(run_dir, cfg)
                checkpoint.verify(cfg)
            return _simulate_locked(
                cfg, run_dir, checkpoint, progress, resume, parent_run_id, extra_callbacks
            )
    except UserError:
        if created:  # a refused run leaves nothing behind
            with suppress(OSError):
                run_dir.rmdir()
        raise


def _simulate_locked(
    cfg: RunConfig,
    run_dir: Path,
    checkpoint: Any,
    progress: bool,
    resume: bool,
    parent_run_id: str | None,
    extra_callbacks: Sequence[Any],
) -> Any:
    from rayfl.engine.callbacks import ProgressBar, RunDirectory, TrackerCallback
    from rayfl.engine.loop import Simulation
    from rayfl.engine.rundir import read_mlflow_run, write_mlflow_run
    from rayfl.tracking import make_tracker
    from rayfl.tracking.provenance import run_name_for

    sim = Simulation(cfg, run_dir)
    out = RunDirectory(run_dir)
    previous = read_mlflow_run(run_dir) if resume else None
    tracker = make_tracker(
        cfg.tracking.backend,
        experiment=cfg.tracking.experiment,
        run_name=cfg.tracking.run_name or run_name_for(cfg),
        tracking_uri=cfg.tracking.uri,
        parent_run_id=parent_run_id,
        run_id=previous["run_id"] if previous else None,
    )
    run_id = getattr(tracker, "run_id", None)
    if cfg.tracking.backend == "mlflow" and run_id:
        write_mlflow_run(run_dir, run_id, getattr(tracker, "tracking_uri", "") or "")
    sim.callbacks = [checkpoint, out, *extra_callbacks, TrackerCallback(tracker, out)]
    if progress:
        sim.callbacks.append(ProgressBar())
    result = sim.run()
    result.run_dir = run_dir
    result.tracker_run_id = run_id
    return result
