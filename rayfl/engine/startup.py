"""A run's start-up clock, and Ray's start through `ray.init`'s documented options only.

The clock's phases (`imports`, `data_load`, `executor` or `ray_start` ... `actors_ready`,
`first_round_at`) go into the first round's row as `time/startup/<phase>_s`.

No code from the working directory: Ray puts the driver's current directory first on every
worker's `sys.path` unless the job has a `working_dir`, so a `json.py` in the folder a command
runs from would be imported by every worker. `init_ray` gives the job an empty `working_dir`,
and `setup_worker` moves each worker back to the driver's directory: relative paths mean in a
worker what they mean in the driver.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import ray

from rayfl import plugins
from rayfl.clusterconfig import join_error
from rayfl.errors import UserError

if TYPE_CHECKING:
    from rayfl.schema import EngineConfig

log = logging.getLogger(__name__)


class StartupClock:
    """Durations of the start-up phases and the time since the process started."""

    def __init__(self) -> None:
        self.origin = psutil.Process().create_time()  # wall clock, when the command started
        self.phases: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = time.perf_counter() - start

    def mark(self, name: str) -> None:
        """Record `name` as the time from the process start to now."""
        self.phases[name] = time.time() - self.origin

    def metrics(self) -> dict[str, float]:
        return {f"time/startup/{k}_s": v for k, v in self.phases.items()}

    def describe(self) -> str:
        return ", ".join(f"{k.replace('_', ' ')} {v:.2f} s" for k, v in self.phases.items())


class _DropRayNotes(logging.Filter):
    """Drops Ray's start-up notes that say nothing to a rayfl user (no SIGTERM handler off the
    main thread; token authentication on for the private cluster), matched by text."""

    def __init__(self, *fragments: str) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("ray"):
            return True
        message = record.getMessage()
        return not any(f in message for f in self.fragments)


DRIVER_CWD = "RAYFL_DRIVER_CWD"  # the driver's current directory, for `setup_worker`


def worker_runtime_env() -> dict[str, Any]:
    """`ray.init`'s `runtime_env`: the plugins' (`rayfl.plugins.runtime_env`), an empty
    `working_dir` (filled in by `init_ray`) so that Ray puts no directory of the driver on the
    workers' `sys.path`, and `setup_worker` as every worker's first step."""
    env = plugins.runtime_env()
    return {
        **env,
        "worker_process_setup_hook": f"{__name__}.setup_worker",
        "env_vars": {**env.get("env_vars", {}), DRIVER_CWD: os.getcwd()},
    }


def setup_worker() -> None:
    """Ray's `worker_process_setup_hook`: the worker runs in the driver's directory (when this
    node has it), as it would without a `working_dir`, and imports the driver's plugins."""
    cwd = os.environ.get(DRIVER_CWD)
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)
    plugins.setup_worker()


def spill_dir(run_dir: str | Path) -> Path:
    """Where a run's private Ray spills objects unless `engine.spill_dir` says otherwise: the
    run's own folder, never a path that other runs share."""
    return Path(run_dir) / "ray-spill"


def init_ray_for_run(e: EngineConfig, spill_dir: str | Path | None = None) -> bool:
    """`init_ray` with a run's `engine` settings (`spill_dir`: the run's default spill folder,
    used when `engine.spill_dir` is not set).

    Raises:
        UserError: the run's spill folder is a symlink (a run directory is untrusted input:
            Ray would write the spilled objects wherever it points).
    """
    if e.spill_dir is None and spill_dir is not None and Path(spill_dir).is_symlink():
        raise UserError(
            f"{spill_dir} is a symlink; a run directory's ray-spill folder must be a real "
            "folder inside it: remove the link, or set engine.spill_dir"
        )
    return init_ray(e.address, e.ray_num_cpus, e.object_store_mb, e.spill_dir or spill_dir)


def init_ray(
    address: str | None,
    num_cpus: int | None,
    object_store_mb: int | None = None,
    spill_dir: str | Path | None = None,
) -> bool:
    """Start a private local Ray (or join `address`); returns True when this call started it.

    A local Ray gets an object store of `object_store_mb` (None: Ray's default, 30% of RAM) and
    spills objects that do not fit to `spill_dir` (None: Ray's default, under its temp dir)
    instead of failing: client state of thousands of clients can outgrow the store.

    `ray.init` replaces the process's SIGTERM handler with one that exits at once; the caller's
    handler (the CLI's, which stops a run like Ctrl-C) is put back.

    Raises:
        UserError: Ray did not start or could not be reached (one line naming the fix): a
            cluster that does not answer, or a local start that failed (Ray's "The current node
            timed out during startup", a raylet that aborted, no room in its temp dir).
    """

    if ray.is_initialized():
        return False
    empty = tempfile.mkdtemp(prefix="rayfl-workdir-")  # uploaded by `ray.init`, then not needed
    kwargs: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": True,
        "configure_logging": False,
        "runtime_env": {**worker_runtime_env(), "working_dir": empty},
    }
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main_thread else None
    notes = [] if main_thread else ["not the main thread"]
    if not address:
        notes.append("Token authentication is enabled for this Ray cluster")
    quiet = _DropRayNotes(*notes)
    # Ray's records reach the handlers of its "ray" logger (it propagates no further) or, when
    # that has none, the root logger's
    found = [*logging.getLogger("ray").handlers, *logging.getLogger().handlers]
    handlers = [h for h in [*found, logging.lastResort] if h is not None]
    for handler in handlers:
        handler.addFilter(quiet)
    try:
        if address:
            ray.init(address=address, **kwargs)
        else:
            if object_store_mb is not None:
                kwargs["object_store_memory"] = int(object_store_mb) * 2**20
            if spill_dir is not None:
                Path(spill_dir).mkdir(parents=True, exist_ok=True)
                # listed in `ray.init`'s docstring ("hidden / experimental" keywords), unlike
                # the private system-config dict ("testing only"); an unknown keyword fails loudly
                kwargs["object_spilling_directory"] = str(Path(spill_dir).resolve())
            ray.init(address="local", num_cpus=num_cpus, **kwargs)
    except (ConnectionError, ray.exceptions.AuthenticationError) as exc:
        if not address:
            raise UserError(start_failure(exc, address)) from None
        raise UserError(join_error(address, exc, os.environ)) from None
    except Exception as exc:  # Ray raises bare `Exception`s for a start that timed out
        raise UserError(start_failure(exc, address)) from None
    finally:
        shutil.rmtree(empty, ignore_errors=True)
        for handler in handlers:
            handler.removeFilter(quiet)
        if main_thread and callable(previous):
            signal.signal(signal.SIGTERM, previous)
    return True


def start_failure(exc: BaseException, address: str | None) -> str:
    """The one line for a Ray start that failed with `exc` (its first line, and the fix)."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    if len(first) > 200:
        first = first[:197] + "..."
    where = f"join engine.address={address!r}" if address else "start a local Ray"
    return (
        f"could not {where} ({first}); the machine may be overloaded (retry, or lower "
        "engine.ray_num_cpus), out of space in Ray's temp dir (set RAY_TMPDIR to a roomier "
        "folder), or use engine.executor=serial"
    )
