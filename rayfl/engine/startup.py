"""A run's start-up, measured and overlapped.

Phases (seconds): `imports` (from the process start to the simulation: interpreter, imports,
config), `ray_start`, `actors_launch` (asking Ray for the actors), `data_load`, `dataset_put`,
`actors_ready`, and `first_round_at` (from the process start to the first round). They are
logged at INFO and added to the first round's row as `time/startup/<phase>_s`.

What overlaps: `ray.init` runs in a thread (when this process starts Ray) from before the
engine's imports (torch) until the data has loaded; the actors' processes start (and import
torch) before the dataset is put, and only then receive the spec and the dataset (`setup`); the
server starts beside the workers. Nothing waits for the actor that scores the server's models
while the next round trains (`engine.pipeline_eval`): it starts when first used, and the last
round's models are scored by the server itself while the clients evaluate.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from rayfl.errors import UserError

if TYPE_CHECKING:
    from rayfl.config import EngineConfig
    from rayfl.data.federated import Federation
    from rayfl.engine.executor import RayExecutor
    from rayfl.engine.spec import RunSpec

log = logging.getLogger(__name__)


class StartupClock:
    """Durations of the start-up phases and the time since the process started."""

    def __init__(self) -> None:
        self.origin = psutil.Process().create_time()  # wall clock, when the command started
        self.phases: dict[str, float] = {}

    def since_start(self) -> float:
        return time.time() - self.origin

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = time.perf_counter() - start

    def mark(self, name: str) -> None:
        """Record `name` as the time from the process start to now."""
        self.phases[name] = self.since_start()

    def metrics(self) -> dict[str, float]:
        return {f"time/startup/{k}_s": v for k, v in self.phases.items()}

    def describe(self) -> str:
        return ", ".join(f"{k.replace('_', ' ')} {v:.2f} s" for k, v in self.phases.items())


class EarlyRay:
    """Starts Ray and then the actors' processes while the caller imports the engine (torch) and
    loads the data; `finish` hands them the spec and the dataset. Creating one imports Ray and
    nothing heavier, so `rayfl run` starts it before torch: Ray's start overlaps the imports.
    Ray is imported here, before the thread starts, not in it: imported beside torch it took
    1.4 s of the GIL-shared process instead of 0.25 s, and Ray's processes started ~1 s after
    the command, with one of the 2 cores idle meanwhile; first round at 4.0 s against 4.2-4.8
    s (`rayfl bench experiments/benchmarks/fedavg_cnn_small.yaml`).

    Created with `imported=False`, the thread imports the executor (torch) only after the
    caller calls `imported.set()`: two threads importing one package with circular imports
    can fail with Python's import-lock `_DeadlockError`. The workers' actors do not wait for
    that: a Ray this thread started gets them at once (`rayfl.engine.pool`, torch-free), and
    their processes import torch beside the driver, as the compute floor's processes do (first
    round at 2.42-2.49 s against 2.92-4.62 s, the actor set up at 3.60-3.76 s against
    3.68-5.83 s, together with `init_ray(prestart=False)`, in a slow hour of the machine).

    When this process has to start Ray, it does so in a thread, which must outlive Ray: Ray's own
    processes (GCS, raylet) are started with a parent-death signal, which Linux sends when the
    *thread* that started them exits. So the thread waits until the executor has shut Ray down
    (`RayExecutor.close`).
    """

    def __init__(
        self,
        engine: EngineConfig,
        per_round: int,
        clock: StartupClock,
        imported: bool = True,
        exits_on_failure: bool = False,
    ) -> None:
        """`exits_on_failure`: the process ends when the run fails before it starts (the CLI),
        so `cancel` need not wait for a Ray that is still starting (see there)."""
        self.executor: RayExecutor | None = None
        self.engine, self.per_round = engine, per_round
        self._exits_on_failure = exits_on_failure
        self._since = time.time()
        self.imported = threading.Event()
        if imported:
            self.imported.set()
        self.error: BaseException | None = None
        self.clock = clock
        self._launched = threading.Event()
        self._cancelled = threading.Event()
        self._release = threading.Event()
        # `ray.init` installs Ray's own SIGTERM handler (it aborts the process); on the main
        # thread `init_ray` puts the caller's back, from a thread it cannot: `finish` does.
        main = threading.current_thread() is threading.main_thread()
        self._sigterm = signal.getsignal(signal.SIGTERM) if main else None
        ray = sys.modules.get("ray")  # not imported: certainly not running
        self._thread_started = not (ray is not None and ray.is_initialized())
        if not self._thread_started:  # nothing slow to hide (tests, Tune trials): this thread
            self.imported.set()  # no second thread imports: nothing to wait for
            self._launch()
        else:
            _register_fork_hooks_first()
            import ray  # noqa: F401  (see the class's docstring)

            threading.Thread(target=self._hold, name="rayfl-ray-start", daemon=True).start()

    def _launch(self) -> None:
        engine, per_round, clock = self.engine, self.per_round, self.clock
        started = False
        try:
            with clock.phase("ray_start"):
                started = init_ray_for_run(engine)
            pool = None
            if started and not self._cancelled.is_set():
                # The workers' processes import torch while this one does (rayfl.engine.pool
                # imports none); a Ray this process started stops with them on a failure.
                from rayfl.engine.pool import start_workers

                with clock.phase("actors_launch"):
                    pool = start_workers(engine, per_round, started)
            self.imported.wait()
            if self._cancelled.is_set():  # the caller failed (a config error): no actors
                return
            from rayfl.engine.executor import RayExecutor

            executor = RayExecutor.__new__(RayExecutor)
            if self._thread_started:
                executor.after_shutdown = self._release.set
            # closes on failure
            executor.launch(engine, per_round, clock, started_ray=started, pool=pool)
            self.executor = executor
        except BaseException as exc:  # re-raised on the caller's thread by `finish`
            self.error = exc
        finally:
            if started and self.executor is None:  # failed or cancelled: stop the Ray it started
                import ray

                if ray.is_initialized():
                    with suppress(Exception):
                        shutdown_ray()
            self._launched.set()

    def _hold(self) -> None:
        self._launch()
        if self.executor is not None:  # launched: hold Ray until the executor shut it down
            self._release.wait()

    def _wait_launched(self) -> None:
        self._launched.wait()
        if callable(self._sigterm) and self._thread_started:
            signal.signal(signal.SIGTERM, self._sigterm)

    def finish(self, spec: RunSpec, federation: Federation) -> RayExecutor:
        self._wait_launched()
        if self.error is not None:
            raise self.error
        assert self.executor is not None
        self.executor.attach(spec, federation, self.clock)
        return self.executor

    def serves(self, engine: EngineConfig, per_round: int) -> bool:
        """Whether this start is the one a run with these settings needs."""
        return (engine, per_round) == (self.engine, self.per_round)

    def cancel(self, wait: bool = False) -> None:
        """Stop what is starting: Ray, once its start is done; actors not yet launched never are.

        Where the process exits next (`exits_on_failure`) and Ray is still starting, its
        processes started so far are killed instead: waiting for `ray.init` to finish and then
        shutting it down would turn a one-line config error into a 9-13 s one. (Ray's own thread
        is left behind, blocked; it must not be reused in this process.) `wait`: wait all the
        same (the process goes on with another Ray)."""
        self._cancelled.set()
        self.imported.set()
        starting = self._thread_started and not self._launched.is_set()
        if self._exits_on_failure and starting and not wait:
            _silence_what_is_left_behind()
            _kill_processes_started_since(self._since)
            return
        self._wait_launched()
        if self.error is None and self.executor is not None:
            self.executor.close()


@contextmanager
def _lean_head() -> Iterator[None]:
    """While a private local Ray starts here: no dashboard server, no autoscaler monitor.

    A run's private Ray needs neither: `include_dashboard=False` already loads none of the
    dashboard's modules but one that reports usage statistics, and a one-node cluster of fixed
    size has nothing to autoscale (rayfl checks the resources a run needs itself, with a
    message). Yet `ray.init` starts both, each a Python process that imports Ray, and waits for
    the dashboard server to answer before it even starts the raylet: 0.8 s of `ray.init`'s
    2.5 s on an idle 2-core machine, more while the driver imports torch beside it, and ~1.5
    CPU-seconds that the workers' start-up competes with. Ray (pinned in pyproject.toml) has no
    public switch for them, so their two start methods of its head node are skipped for the
    duration of this `ray.init` (where Ray changes and they are gone, nothing is skipped).
    Worker logs still reach the driver (the log monitor stays), and `ray status` works.

    Ray's check of its dashboard's dependencies (`_dashboard_dependency_error`) finds them
    without importing them: ray.init 2.45 s against 2.75 s, first round at 4.2-4.3 s against
    4.5 s, in a benchmark run where the driver imports torch beside it."""
    from ray._private import node, utils

    names = ("start_api_server", "start_monitor")
    saved = {n: getattr(node.Node, n, None) for n in names}
    check = getattr(utils, "get_dashboard_dependency_error", None)
    if any(v is None for v in saved.values()) or check is None:
        yield
        return
    for n in names:
        setattr(node.Node, n, _skip)
    utils.get_dashboard_dependency_error = _dashboard_dependency_error
    try:
        yield
    finally:
        for n, method in saved.items():
            setattr(node.Node, n, method)
        utils.get_dashboard_dependency_error = check


def _skip(*args: Any, **kwargs: Any) -> None:
    return None


def _dashboard_dependency_error() -> ImportError | None:
    """Ray's check whether its dashboard's dependencies are installed (which decides whether
    its node agent runs `--minimal`), without importing them: Ray imports aiohttp, grpc,
    opencensus, opentelemetry, prometheus_client and pydantic in the driver only to find out,
    ~0.15 s on an idle machine and ~0.5 s of the driver's time while it imports torch beside
    it. `find_spec` finds the same packages without running them."""
    import importlib.util

    for name in _DASHBOARD_DEPENDENCIES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return ImportError(f"No module named {name!r}")
    return None


# What `ray.dashboard.optional_deps` imports (Ray 2.60)
_DASHBOARD_DEPENDENCIES = (
    "aiohttp",
    "aiohttp_cors",
    "grpc",
    "opencensus",
    "opentelemetry",
    "opentelemetry.exporter.prometheus",
    "opentelemetry.proto",
    "prometheus_client",
    "pydantic",
)


def shutdown_ray() -> None:
    """`ray.shutdown()`, without its 1 s wait for the autoscaler's monitor.

    Ray stops the processes it started one after another, giving each 1 s to exit after a
    SIGTERM before it kills it. The autoscaler's monitor (which has nothing to do on a private
    local Ray) does not exit in that time, so every shutdown waited 1 s for it and then killed it
    anyway (1.35 s against 0.1 s measured here): it is killed first. On a joined cluster this
    process started no monitor, and `ray.shutdown()` only disconnects."""
    import ray

    killed = descendants_running(_MONITOR_SCRIPT)
    for child in killed:
        with suppress(psutil.Error):
            child.kill()
    deadline = time.monotonic() + 1.0
    for child in killed:  # dead (a zombie, which Ray reaps) before Ray looks at it
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.002)
    ray.shutdown()


def descendants_running(script: str) -> list[psutil.Process]:
    """This process's descendants whose command line runs `script` (a path ending)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        with suppress(psutil.Error):
            if any(part.endswith(script) for part in child.cmdline()):
                found.append(child)
    return found


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


_MONITOR_SCRIPT = os.path.join("autoscaler", "_private", "monitor.py")


def _register_fork_hooks_first() -> None:
    """Before a thread that forks (Ray's start spawns its processes with a `preexec_fn`, which
    runs the `os.register_at_fork` hooks) while this one imports torch: import here the modules
    that register a pair of hooks, one before a fork and one after it in the parent. CPython
    runs the "before" hooks from a copy of its list and the "after" ones from the list as it
    is then; a pair registered in between, while the other thread's "before" hooks run Python
    code, has its "after" hook run alone. torch's import of `concurrent.futures.thread` did
    that: its `_global_shutdown_lock.release` raised "release unlocked lock", and Python
    printed that traceback above a config error's one line (seen in CI). 7 ms."""
    import concurrent.futures.thread  # noqa: F401


def _silence_what_is_left_behind() -> None:
    """Before Ray's processes are killed under its starting thread: that thread, and what Ray
    left to the garbage collector, may then fail (a process spawn that fails, a pipe that
    closed), and Python would print their tracebacks ahead of the user's one-line error (seen
    once in CI). The process exits next with that error: what fails behind it says nothing."""
    previous = threading.excepthook

    def thread_hook(args: Any) -> None:
        if args.thread is None or args.thread.name != "rayfl-ray-start":
            previous(args)

    threading.excepthook = thread_hook
    sys.unraisablehook = lambda unraisable: None


def _kill_processes_started_since(since: float) -> None:
    """Kill this process's descendants started at or after `since` (Ray's GCS, raylet, agents
    and workers: the raylet's children go with it)."""
    me = psutil.Process()
    started = []
    for child in me.children(recursive=True):
        with suppress(psutil.Error):
            if child.create_time() >= since - 1.0:  # create_time has a coarse clock
                started.append(child)
    for child in started:
        with suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(started, timeout=2)


# The raylet connects to its own object store's socket, which its store thread may not have
# opened yet; Ray retries 10 times at 1 s (`raylet_client_*`), so about every other `ray.init`
# waited 1 s more (ray.init 2.7 s against 1.75 s on an idle 2-core machine, its raylet.out showing
# the second between "Plasma store debug dump" and "ObjectManager server started"). Same 10 s
# deadline, retried every 20 ms: 8 starts in 8 at 1.71-1.80 s. Clients of the raylet (workers,
# the driver) connect with the same settings.
_CONNECT_RETRIES = {
    "raylet_client_connect_timeout_milliseconds": 20,
    "raylet_client_num_connect_attempts": 500,
}


# Ray lowers its workers' priority to niceness 15 so that on a shared cluster its own daemons
# stay responsive. In a run's private Ray the workers are the run: at 15 they lose every core
# that anything else wants, the driver's threads included. The last round's evaluation, where
# the driver scores the server test set in one thread and its clients in another beside the
# actor (three streams on the 2-core benchmark), gave the actor 17-37% of a core: 2 to 6 of 20
# clients in 0.99-1.13 s; at the driver's niceness it took 10 and the phase 0.82-0.83 s.
_WORKERS_AT_DRIVER_PRIORITY = {"worker_niceness": 0}


class _DropRayNotes(logging.Filter):
    """Drops Ray's start-up warnings that say nothing to a rayfl user: that `ray.init` off the
    main thread sets no SIGTERM handler (rayfl puts the caller's back), and that the private
    local cluster it starts has token authentication on (it is on; the cluster lives as long as
    the run). A config error found while Ray starts must stay the only line on stderr."""

    def __init__(self, *fragments: str) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(f in message for f in self.fragments)


_RAY_START_LOGGERS = (
    "ray._private.worker",
    "ray._private.authentication.authentication_token_setup",
)


def init_ray_for_run(e: EngineConfig) -> bool:
    """`init_ray` with a run's `engine` settings: its actors follow at once, so no prestart."""
    return init_ray(
        e.address, e.ray_num_cpus, e.object_store_mb, e.spill_dir, lean=e.lean_ray, prestart=False
    )


def init_ray(
    address: str | None,
    num_cpus: int | None,
    object_store_mb: int | None = None,
    spill_dir: str | None = None,
    lean: bool = False,
    prestart: bool = True,
) -> bool:
    """Start a private local Ray (or join `address`); returns True when this call started it.

    `lean` (`engine.lean_ray`): the private local Ray starts without its dashboard server and
    its autoscaler's monitor (see `_lean_head`). `prestart=False`: it starts no worker process
    before a task or actor asks for one. Ray otherwise starts one per CPU as the driver
    connects, which helps where tasks come later (Tune's trials); a run creates its actors as
    soon as Ray is up (`EarlyRay`), and with the driver training there is one actor on the
    2-core benchmark: the other process, ~80 MB and ~0.4 s of CPU while the driver imports
    torch, was never used.

    A local Ray gets an object store of `object_store_mb` (None: Ray's default, 30% of RAM) and
    spills objects that do not fit to `spill_dir` (None: Ray's default, under its temp dir)
    instead of failing: client state of thousands of clients can outgrow the store.

    `ray.init` replaces the process's SIGTERM handler with one that exits at once; the caller's
    handler (the CLI's, which stops a run like Ctrl-C) is put back.
    """
    import ray

    from rayfl.plugins import runtime_env

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": True,
        "configure_logging": False,
    }
    if runtime_env():  # every worker imports the user's plugins first (rayfl.plugins)
        kwargs["runtime_env"] = runtime_env()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main_thread else None
    notes = [] if main_thread else ["not the main thread"]  # `finish` restores the handler
    if not address:
        notes.append("Token authentication is enabled for this Ray cluster")
    quiet = _DropRayNotes(*notes)
    loggers = [logging.getLogger(n) for n in _RAY_START_LOGGERS]
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        if address:
            ray.init(address=address, **kwargs)
        else:
            system: dict[str, Any] = {**_CONNECT_RETRIES, **_WORKERS_AT_DRIVER_PRIORITY}
            if not prestart:
                system["prestart_worker_first_driver"] = False
            if object_store_mb is not None:
                kwargs["object_store_memory"] = int(object_store_mb) * 2**20
            if spill_dir is not None:
                Path(spill_dir).mkdir(parents=True, exist_ok=True)
                spilling = {"type": "filesystem", "params": {"directory_path": str(spill_dir)}}
                system["object_spilling_config"] = json.dumps(spilling)
            kwargs["_system_config"] = system
            with _lean_head() if lean else nullcontext():
                ray.init(address="local", num_cpus=num_cpus, **kwargs)
    except (ConnectionError, ray.exceptions.AuthenticationError) as exc:
        from rayfl.clusterconfig import join_error

        raise UserError(join_error(address or "", exc, os.environ)) from None
    except (TimeoutError, ray.exceptions.GetTimeoutError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        where = f"join engine.address={address!r}" if address else "start a local Ray"
        raise UserError(
            f"could not {where} ({first}); the machine may be overloaded or out of /tmp space "
            "(set RAY_TMPDIR), or use engine.executor=serial"
        ) from None
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)
        if main_thread and callable(previous):
            signal.signal(signal.SIGTERM, previous)
    return True
