"""`EarlyRay`: a run's Ray and its workers' actors, started while the driver imports and loads.

What overlaps: `ray.init` runs in a thread (when this process starts Ray) from before the
engine's imports (torch) until the data has loaded; the actors' processes start (and import
torch) before the dataset is put, and only then receive the spec and the dataset (`setup`); the
server starts beside the workers.
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING

from rayfl.engine.startup import StartupClock, init_ray_for_run

if TYPE_CHECKING:
    from rayfl.data.federated import Federation
    from rayfl.engine.ray_executor import RayExecutor
    from rayfl.engine.spec import RunSpec
    from rayfl.schema import EngineConfig


class EarlyRay:
    """Starts Ray and then the actors' processes while the caller imports the engine (torch) and
    loads the data; `finish` hands them the spec and the dataset. Creating one imports Ray and
    nothing heavier, so `rayfl run` starts it before torch: Ray's start overlaps the imports.
    Ray is imported here, before the thread starts, not in it: imported beside torch it took
    1.4 s of the GIL-shared process instead of 0.25 s (2026-12-02, 2-core machine).

    Created with `imported=False`, the thread imports the executor (torch) only after the
    caller calls `imported.set()`: two threads importing one package can fail with Python's
    import-lock `_DeadlockError`. The workers' actors do not wait for that: a Ray this thread
    started gets them at once (`rayfl.engine.pool`, torch-free), and their processes import
    torch beside the driver.

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
        spill_dir: str | Path | None = None,
    ) -> None:
        """`spill_dir`: where a private Ray spills objects when `engine.spill_dir` is not set
        (the run's own folder)."""
        self.executor: RayExecutor | None = None
        self.engine, self.per_round = engine, per_round
        self.spill_dir = spill_dir
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
        self._thread_started = not ray_running()
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
                started = init_ray_for_run(engine, self.spill_dir)
            pool = None
            # per-architecture pools wait for the clients' architectures (`RayExecutor.attach`)
            if started and not self._cancelled.is_set() and not engine.resources_by_arch:
                # The workers' processes import torch while this one does (rayfl.engine.pool
                # imports none); a Ray this process started stops with them on a failure.
                from rayfl.engine.pool import start_workers

                with clock.phase("actors_launch"):
                    pool = start_workers(engine, per_round)
            self.imported.wait()
            if self._cancelled.is_set():  # the caller failed (a config error): no actors
                return
            from rayfl.engine.ray_executor import RayExecutor

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
                        ray.shutdown()
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

    def cancel(self) -> None:
        """Stop what is starting: Ray, once its start is done (`ray.shutdown()`); actors not
        yet launched never are. A config error found while Ray starts therefore waits for the
        rest of Ray's start and its shutdown (see docs/performance.md)."""
        self._cancelled.set()
        self.imported.set()
        self._wait_launched()
        if self.error is None and self.executor is not None:
            self.executor.close()


def ray_running() -> bool:
    """Whether this process is connected to a Ray already (a run then joins it, and starts none)."""
    ray = sys.modules.get("ray")  # not imported: certainly not running
    return ray is not None and bool(ray.is_initialized())


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
