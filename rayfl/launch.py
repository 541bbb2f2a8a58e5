"""Building and running one simulation from a config: the one road that `rayfl run`, suites,
sweeps and benchmarks take. The CLI only parses arguments and prints what this returns.

Ray and the engine are imported inside the functions that need them, so importing this module
(as `rayfl validate` does) starts and imports nothing heavy.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any, NoReturn

from rayfl import plugins
from rayfl.config import RunConfig, apply_overrides, build_config, ray_preview, read_yaml


def default_run_dir(cfg: RunConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{cfg.name}-{cfg.algorithm.name}-s{cfg.seed}-{stamp}"


def load_for_run(
    path: str | Path, overrides: Sequence[str] = (), run_dir: str | Path | None = None
) -> tuple[RunConfig, Any]:
    """Read and check a run's config for a process that runs it and then exits (`rayfl run`,
    a benchmark's variant). For a run on Ray, Ray starts first, in a thread, so that its start
    overlaps the check (which imports torch, ~3 s): returns the config and that
    `rayfl.engine.early.EarlyRay` (None when not on Ray), for `simulate(..., early=...)`.
    `run_dir`, when known: a private Ray spills objects under it (`spill_dir`), unless
    `engine.spill_dir` says otherwise. A config error stops Ray (once started) and is raised.
    (A resume reads its untrusted run directory through `rayfl.engine.rundir.resume_config`.)"""
    raw = read_yaml(path)
    # named before Ray starts: its workers import them (rayfl.plugins.runtime_env)
    plugins.take(apply_overrides(raw, overrides))
    early = None
    preview = ray_preview(raw, overrides)
    if preview is not None:
        from rayfl.engine.early import EarlyRay
        from rayfl.engine.startup import StartupClock, spill_dir
        from rayfl.resources import check_local

        engine, per_round = preview
        # refused here, before Ray starts: a GPU asked of a machine without one would
        # otherwise stop the run only once Ray is up (rayfl.resources)
        check_local(engine)
        spill = None if run_dir is None else spill_dir(run_dir)
        early = EarlyRay(engine, per_round, StartupClock(), imported=False, spill_dir=spill)
    try:
        return build_config(raw, overrides), early
    except BaseException:
        if early is not None:
            early.cancel()
        raise


def simulate(
    cfg: RunConfig,
    run_dir: str | Path,
    *,
    progress: bool = True,
    resume: bool = False,
    parent_run_id: str | None = None,
    extra_callbacks: Sequence[Any] = (),
    early: Any = None,
    existing: str = "refuse",
) -> Any:
    """Run one simulation with the standard callbacks (run directory, checkpoints, tracker, progress).

    Before any data is loaded or Ray started: the run directory is created and checked writable,
    locked for this process (a second run on it stops with one line) and, for a resume, its
    checkpoint is verified. A resume continues the MLflow run recorded in the directory.
    `early`: a `rayfl.engine.early.EarlyRay` already starting Ray for this run (`rayfl run`
    starts it before checking the config); the simulation owns it from here.
    `existing`: what a new run does with a run already in `run_dir`: `refuse` (one line),
    `archive` (moved aside, `--force`) or `replace` (a suite's or sweep's own rerun).
    """
    from rayfl.engine.checkpoint import Checkpoint
    from rayfl.engine.rundir import RunLock, archive, check_mlflow_ref, check_writable, is_run
    from rayfl.errors import UserError

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
            owned, early = early, None
            return _simulate_locked(
                cfg, run_dir, checkpoint, progress, resume, parent_run_id, extra_callbacks, owned
            )
    except UserError:
        if created:  # a refused run leaves nothing behind
            with suppress(OSError):
                run_dir.rmdir()
        raise
    finally:
        if early is not None:  # failed before the simulation took it over
            early.cancel()


def _simulate_locked(
    cfg: RunConfig,
    run_dir: Path,
    checkpoint: Any,
    progress: bool,
    resume: bool,
    parent_run_id: str | None,
    extra_callbacks: Sequence[Any],
    early: Any,
) -> Any:
    from rayfl.config import clients_per_round
    from rayfl.engine.early import EarlyRay, ray_running
    from rayfl.engine.startup import StartupClock, spill_dir
    from rayfl.resources import check_local

    # Ray starts first, in a thread, while this thread imports the engine (torch) and loads data.
    per_round = clients_per_round(cfg)
    if early is not None and not early.serves(cfg.engine, per_round):
        early.cancel()  # not from the CLI: same file and overrides, same settings
        early = None
    if early is None and cfg.engine.executor == "ray":
        if not ray_running():  # a private Ray: refused before it starts, as by `rayfl run`
            check_local(cfg.engine)
        early = EarlyRay(
            cfg.engine, per_round, StartupClock(), imported=False, spill_dir=spill_dir(run_dir)
        )
    clock = early.clock if early is not None else StartupClock()
    try:
        from rayfl.engine.callbacks import ProgressBar, RunDirectory, TrackerCallback
        from rayfl.engine.loop import Simulation
        from rayfl.engine.rundir import read_mlflow_run, write_mlflow_run
        from rayfl.tracking import make_tracker
        from rayfl.tracking.provenance import run_name_for
    except BaseException:
        if early is not None:
            early.cancel()
        raise
    if early is not None:
        early.imported.set()

    sim = Simulation(cfg, run_dir, clock=clock, early=early)  # owns `early` from here
    try:
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
        sim.callbacks = [checkpoint, out]
        sim.callbacks += list(extra_callbacks)
        sim.callbacks.append(TrackerCallback(tracker, out))
        if progress:
            sim.callbacks.append(ProgressBar())
    except BaseException:  # nothing ran yet: stop what is starting
        sim.cancel()
        raise
    result = sim.run()
    result.run_dir = run_dir
    result.tracker_run_id = run_id
    return result


def exit_now(code: int) -> NoReturn:
    """End this process as the interpreter would, without its teardown: wait for the threads it
    would wait for, run the `atexit` functions (logging, MLflow, Ray, temporary files), flush
    stdout and stderr, exit. What is skipped is freeing every module and object one by one,
    which after a run (torch, Ray, the dataset) takes 1.5-1.9 s of a 4-round benchmark on this
    machine, against 0.1 s here. For the processes that run one command and exit: `rayfl` and
    the benchmark's children; never inside a process that goes on."""
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with suppress(Exception):
            stream.flush()
    os._exit(code)
