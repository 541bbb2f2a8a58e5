"""A run's start-up, measured and overlapped.

Phases (seconds): `imports` (from the process start to the simulation: interpreter, imports,
config), `ray_start`, `actors_launch` (asking Ray for the actors), `data_load`, `dataset_put`,
`actors_ready`, and `first_round_at` (from the process start to the first round). They are
logged at INFO and added to the first round's row as `time/startup/<phase>_s`.

What overlaps: `ray.init` runs in a thread while the data loads (when this process starts Ray);
the actors' processes start (and import torch) before the dataset is put, and only then receive
the spec and the dataset (`setup`); the server and the evaluation actor start beside the workers.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import psutil

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
    """Starts Ray and the actors' processes while the caller loads the data; `finish` hands them
    the spec and the dataset. `ray.init` runs in a thread when this process has to start Ray.

    That thread must outlive Ray: Ray's own processes (GCS, raylet) are started with a
    parent-death signal, which Linux sends when the *thread* that started them exits. So the
    thread waits until the executor has shut Ray down (`RayExecutor.close`).
    """

    def __init__(self, engine: EngineConfig, per_round: int, clock: StartupClock) -> None:
        import ray

        from rayfl.engine.executor import RayExecutor

        self.executor = RayExecutor.__new__(RayExecutor)
        self.error: BaseException | None = None
        self._args: tuple[Any, ...] = (engine, per_round, clock)
        self._launched = threading.Event()
        self._release = threading.Event()
        # `ray.init` installs Ray's own SIGTERM handler (it aborts the process); on the main
        # thread `init_ray` puts the caller's back, from a thread it cannot: `finish` does.
        main = threading.current_thread() is threading.main_thread()
        self._sigterm = signal.getsignal(signal.SIGTERM) if main else None
        self._thread_started = False
        if ray.is_initialized():  # nothing slow to hide (tests, Tune trials): stay on this thread
            self._launch()
        else:
            self._thread_started = True
            self.executor.after_shutdown = self._release.set
            threading.Thread(target=self._hold, name="rayfl-ray-start", daemon=True).start()

    def _launch(self) -> None:
        try:
            self.executor.launch(*self._args)
        except BaseException as exc:  # re-raised on the caller's thread by `finish`
            self.error = exc
        finally:
            self._launched.set()

    def _hold(self) -> None:
        self._launch()
        if self.error is None:
            self._release.wait()

    def _wait_launched(self) -> None:
        self._launched.wait()
        if callable(self._sigterm) and self._thread_started:
            signal.signal(signal.SIGTERM, self._sigterm)

    def finish(self, spec: RunSpec, federation: Federation) -> RayExecutor:
        self._wait_launched()
        if self.error is not None:
            raise self.error
        self.executor.attach(spec, federation, self._args[2])
        return self.executor

    def cancel(self) -> None:
        self._wait_launched()
        if self.error is None:
            self.executor.close()
