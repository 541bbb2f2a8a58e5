"""`RayExecutor`: a pool of long-lived `ClientWorker` actors with fractional CPU/GPU reservations,
and the server half in the driver or in a `ServerActor` (`engine.server_in`). Client state stays
in Ray's object store as references the driver owns, never in its heap.

Faults: a worker that dies is restarted by Ray and its call re-run (`max_restarts`,
`max_task_retries`; `rayfl.engine.pool.start_workers`), with the same client states and seeds:
the same numbers. The server actor is restarted here instead, from the last server state the
driver owns: Ray's restart would bring it back with a fresh server state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from rayfl.data.federated import Federation
from rayfl.engine.executor import Executor, StateView, longest_first
from rayfl.engine.pool import start_workers
from rayfl.engine.server import ServerActor, ServerEvaluator, ServerRunner
from rayfl.engine.spec import RunSpec, resolve_device
from rayfl.engine.startup import StartupClock, init_ray_for_run
from rayfl.engine.worker import ClientMetrics
from rayfl.errors import UserError
from rayfl.schema import server_in_driver

log = logging.getLogger(__name__)


def ray_get(refs: Any, timeout: float | None = None) -> Any:
    """`ray.get` that re-raises a user error raised inside an actor as itself (its one line),
    not wrapped in Ray's `RayTaskError` with the remote traceback."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, UserError):
            raise exc.cause from None
        raise


def ray_get_first(refs: Sequence[Any]) -> Any:
    """`ray_get` of the first of one call's returns. When it raises, the call's other returns
    (the same error, or not made yet) are read and dropped: Ray would otherwise print each as an
    unhandled error, with its remote traceback, whenever it is freed. Ray stores them one by one
    after the first, so they are awaited (up to 5 s in all) unless an interrupt ended the read."""
    try:
        return ray_get(refs[0])
    except BaseException as exc:
        deadline = time.monotonic() + (5.0 if isinstance(exc, Exception) else 0.0)
        for ref in refs[1:]:
            with suppress(Exception):
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        raise


class RayExecutor(Executor):
    """Workers on Ray; the server in the driver (`local`, a `ServerRunner`) or in a server actor,
    with an evaluation actor for its pipelined scoring.

    Built in one step: Ray started (unless already connected; a Ray it started it stops in
    `close`, spilling to `spill_dir` unless `engine.spill_dir` is set), the actors created, the
    dataset put once (every actor maps it zero-copy) and every actor set up.

    In the driver, the server costs no process of its own, its replies are read zero-copy, and
    its models are scored in a thread of this process while the clients train or evaluate."""

    def __init__(
        self,
        spec: RunSpec,
        federation: Federation,
        clock: StartupClock | None = None,
        spill_dir: str | Path | None = None,
    ) -> None:
        super().__init__(spec)
        e = spec.engine
        self.workers: list[Any] = []
        self.placements: dict[int, int] = {}  # client -> the worker that last ran it
        self.server: Any = None
        self.local: ServerRunner | None = None  # the server half, when it runs in the driver
        self.evaluator: Any = None
        self._server_ready: Any = None
        self._final_scoring: _Scoring | None = None
        self._scorer: ThreadPoolExecutor | None = None  # scores a driver server's models
        # the last server state, owned by the driver: a restarted server starts from it
        self._server_state: Any = None
        self._clock = clock = clock or StartupClock()
        with clock.phase("ray_start"):
            self._started_ray = init_ray_for_run(e, spill_dir)
        try:
            with clock.phase("actors_launch"):
                self.pool = start_workers(e, spec.per_round, spec.archs)
                self.workers, self.placements = self.pool.actors, self.pool.placements
                res, where = e.server_resources, self.pool.server_options
                self._server_cls: Any = ray.remote(ServerActor).options(
                    num_cpus=res.num_cpus, num_gpus=res.num_gpus, **where
                )
                if not server_in_driver(e):  # its process starts while the dataset is put
                    self.server = self._server_cls.remote()
                # No CPU of its own: it fills the time workers spend off the CPU. Started on
                # first use; stateless, so Ray restarts it and re-runs its call when it dies.
                self._evaluator_cls: Any = ray.remote(ServerEvaluator).options(
                    num_cpus=0, num_gpus=0, max_restarts=-1, max_task_retries=e.max_retries
                )
            self._train_sizes = [len(c.train) for c in federation.clients]
            self._test_sizes = [len(c.test) for c in federation.clients]
            with clock.phase("dataset_put"):
                self._federation_ref = ray.put(federation)
            # every worker call carries these (a restarted worker sets itself up from them)
            self._setup = [ray.put(spec), self._federation_ref]
            ready = [w.setup.remote(self._setup) for w in self.workers]
            if server_in_driver(e):
                # The driver is no actor (no GPU ids from Ray): the device as for serial runs
                self.local = ServerRunner(spec, federation, resolve_device(spec.device))
            else:
                self._server_ready = self.server.setup.remote(spec, self._federation_ref)
                ready.append(self._server_ready)
            self._await_ready(ready)
        except BaseException:
            self.close()
            raise
        log.info("Ray executor: %d workers", len(self.workers))

    def _await_ready(self, ready: list[Any]) -> None:
        """Wait for the actors' setup calls `ready` (a setup error, e.g. no GPU, surfaces here as
        itself), then for every actor to answer."""
        with self._clock.phase("actors_ready"):
            deadline = time.monotonic() + self.spec.engine.startup_timeout_s
            for ref in ready:
                with suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    ray_get(ref, timeout=max(0.0, deadline - time.monotonic()))
            self._await_started(deadline)

    def _new_server(self) -> None:
        with suppress(Exception):
            if self.server is not None:
                ray.kill(self.server)
        self.server = server = self._server_cls.remote(self.spec, self._federation_ref)
        state = self._server_state
        self._server_ready = (
            server.device.remote() if state is None else server.load_state_dict.remote(state)
        )

    def _await_started(self, deadline: float | None = None) -> None:
        """Wait until every worker and the server answer (Ray restarts workers that die; a
        server actor that died is replaced here); a UserError past `deadline` (default:
        `engine.startup_timeout_s` from now) or when they keep dying."""
        e = self.spec.engine
        if deadline is None:
            deadline = time.monotonic() + e.startup_timeout_s
        for _ in range(e.max_retries + 1):
            probes = [w.info.remote(self._setup) for w in self.workers]
            if self._server_ready is not None:
                probes.append(self._server_ready)
            server_died = False
            for i, ref in enumerate(probes):
                try:
                    ray_get(ref, timeout=max(0.0, deadline - time.monotonic()))
                except ray.exceptions.GetTimeoutError:
                    raise UserError(
                        f"the Ray workers and server did not start within "
                        f"engine.startup_timeout_s={e.startup_timeout_s:g} s: the cluster lacks "
                        "free resources or is overloaded (`ray status` shows them; raise "
                        "engine.startup_timeout_s or lower engine.num_workers / "
                        "engine.worker_resources), or a node's Ray workers cannot import rayfl "
                        "or a plugin (Ray printed the import error above; install rayfl and the "
                        "plugins' files on every node)"
                    ) from None
                except ray.exceptions.RayActorError:
                    if i < len(self.workers):  # Ray gave up on it: more deaths than retries
                        break
                    server_died = True
            else:
                if not server_died:
                    self._server_ready = None
                    return
            log.warning("Ray actors died while starting; waiting for their restart")
            if server_died:
                self._new_server()
        raise UserError(
            f"Ray actors died {e.max_retries + 1} times while starting; check memory "
            "(engine.worker_resources, engine.server_resources) or raise engine.max_retries"
        )

    def _with_server(self, why: str, call: Callable[[], Any]) -> Any:
        """Run `call` (which uses `self.server`); on a dead server restart it from the last server
        state and run it again. (A server in the driver lives and dies with the run.)"""
        if self.local is not None:
            return call()
        retries = self.spec.engine.max_retries
        for attempt in range(retries + 1):
            try:
                return call()
            except ray.exceptions.RayActorError:
                if attempt == retries:
                    raise UserError(
                        f"{why}: the server actor died {attempt + 1} times; check memory "
                        "(engine.server_resources) or raise engine.max_retries"
                    ) from None
                log.warning("%s: the server actor died; restarting it from the last state", why)
                self._new_server()
                self._await_started()
        raise AssertionError("unreachable")

    def worker_info(self) -> list[dict[str, Any]]:
        """The workers' `ClientWorker.info` (device, GPU ids, peak GPU memory)."""
        return ray_get([w.info.remote(self._setup) for w in self.workers])

    def broadcast(
        self, round_idx: int, archs: Sequence[str]
    ) -> tuple[dict[str, int], dict[str, Any]]:
        if self.local is not None:  # put once; every worker maps it zero-copy
            sizes, payloads = self.local.broadcast(round_idx, list(archs))
            self._start_final_scoring()
            return sizes, {a: ray.put(p) for a, p in zip(archs, payloads)}

        def call() -> tuple[dict[str, int], dict[str, Any]]:
            refs = self.server.broadcast.options(num_returns=1 + len(archs)).remote(
                round_idx, list(archs)
            )
            self._start_final_scoring()  # queued behind the broadcast, not ahead of it
            return ray_get_first(refs), dict(zip(archs, refs[1:]))

        return self._with_server("broadcast", call)

    def fit(
        self, round_idx: int, client_ids: Sequence[int], payloads: dict[str, Any], evaluate: bool
    ) -> tuple[list[ClientMetrics], list[Any]]:
        """Batches of `engine.clients_per_call` clients, handed to whichever worker is free; the
        states travel as object references (the driver never holds them)."""
        timeout = self.spec.engine.round_timeout_s
        metrics: list[ClientMetrics] = []
        reply_refs: list[Any] = []

        def submit(worker: Any, batch: list[int], states: list[Any]) -> Any:
            return worker.fit.options(num_returns=2 + len(batch)).remote(
                self._setup, round_idx, batch, payloads, evaluate, *states
            )

        def record(batch: list[int], refs: Any) -> None:
            metrics.extend(ray_get_first(refs))
            reply_refs.append(refs[1])
            self.states.update(zip(batch, refs[2:]))
            self._report("fit", len(metrics), len(client_ids))

        deadline = None if timeout is None else time.monotonic() + timeout
        order = longest_first(client_ids, self._train_sizes)
        self.pool.dispatch(round_idx, order, self.states, submit, record, deadline)
        return metrics, reply_refs

    def evaluate(
        self, round_idx: int, client_ids: Sequence[int], payloads: dict[str, Any]
    ) -> list[ClientMetrics]:
        """As `fit`; evaluation changes no state."""
        rows: list[ClientMetrics] = []

        def submit(worker: Any, batch: list[int], states: list[Any]) -> Any:
            return worker.evaluate.remote(self._setup, round_idx, batch, payloads, *states)

        def record(_: list[int], ref: Any) -> None:
            rows.extend(ray_get(ref))
            self._report("eval", len(rows), len(client_ids))

        order = longest_first(client_ids, self._test_sizes)
        self.pool.dispatch(round_idx, order, self.states, submit, record)
        return rows

    def server_step(self, round_idx: int, replies: list[Any], evaluate: bool) -> dict[str, float]:
        if self.local is not None:
            return self.local.step(round_idx, ray_get(replies), evaluate)

        # The replies are objects the driver owns: a restarted server steps on the same ones.
        def call() -> dict[str, float]:
            metrics, state = self.server.step_and_state.options(num_returns=2).remote(
                round_idx, evaluate, *replies
            )
            out = ray_get_first([metrics, state])
            self._server_state = state
            return out

        return self._with_server(f"round {round_idx}", call)

    def server_step_deferred(
        self, round_idx: int, replies: list[Any], evaluate: bool, final: bool = False
    ) -> tuple[dict[str, float], Any]:
        """The step now, its models scored meanwhile: by the evaluation actor (started on first
        use) while the next round's clients train, or, in the `final` round, by the server
        itself, idle from then on, while the clients evaluate."""

        def call() -> tuple[dict[str, float], Any]:
            if self.local is not None:
                out, models = self.local.step_deferred(round_idx, ray_get(replies), evaluate)
            else:
                metrics, state, models = self.server.step_deferred.options(num_returns=3).remote(
                    round_idx, evaluate, *replies
                )
                out = ray_get_first([metrics, state, models])
                self._server_state = state
            if not evaluate:
                return out, None
            if final:  # submitted after the deployed evaluation's broadcast (`broadcast`)
                self._final_scoring = _Scoring(models)
                return out, self._final_scoring
            if self.local is not None:  # scored in a thread of this process, not by an actor
                return out, _Scoring(models, self._score_in_driver(models))
            return out, _Scoring(models, self._evaluate_remote(models))

        return self._with_server(f"round {round_idx}", call)

    def _start_final_scoring(self) -> None:
        """The server's actor runs one call at a time: the last round's scoring goes after the
        broadcast that the clients' evaluation needs, so the two evaluations overlap."""
        scoring, self._final_scoring = self._final_scoring, None
        if scoring is None:
            return
        if self.local is not None:
            scoring.ref = self._score_in_driver(scoring.models)
        else:
            scoring.ref = self.server.score.remote(scoring.models)

    def _score_in_driver(self, models: Any) -> Future[dict[str, float]]:
        """The server's models scored by a thread of this process (the server runs here)."""
        assert self.local is not None
        if self._scorer is None:
            self._scorer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rayfl-score")
        return self._scorer.submit(self.local.score, models)

    def collect_eval(self, handle: Any) -> dict[str, float]:
        if handle is None:
            return {}
        if handle.ref is None:  # the last round's, with no broadcast after it
            self._start_final_scoring()
        if isinstance(handle.ref, Future):
            return handle.ref.result()
        try:
            return ray_get(handle.ref)  # the evaluator's call is re-run by Ray if it died
        except ray.exceptions.RayActorError:  # the server actor, scoring the last round's
            log.warning("the server actor died while scoring its models; scoring them again")
            return ray_get(self._evaluate_remote(handle.models))

    def _get(self, handle: Any) -> Any:
        return ray_get(handle) if isinstance(handle, ray.ObjectRef) else handle

    def _put(self, value: Any) -> Any:
        return ray.put(value)

    def snapshot(self) -> StateView:
        # a driver server's state_dict() is a fresh copy, as for the serial executor
        server = self._server_state if self.local is None else self.local.state_dict()
        return StateView(dict(self.states), server, self._get)

    def _evaluate_remote(self, models: Any) -> Any:
        """The server's models scored by the evaluation actor (started on first use)."""
        if self.evaluator is None:
            self.evaluator = self._evaluator_cls.remote(self.spec, self._federation_ref)
        return self.evaluator.score.remote(models)

    def server_state(self) -> dict[str, Any]:
        if self.local is not None:
            return self.local.state_dict()
        if self._server_state is not None:
            return ray_get(self._server_state)
        return self._with_server("server state", lambda: ray_get(self.server.state_dict.remote()))

    def load_server_state(self, state: dict[str, Any]) -> None:
        if self.local is not None:
            self.local.load_state_dict(state)
            return
        self._server_state = ray.put(state)
        self._with_server(
            "load server state",
            lambda: ray_get(self.server.load_state_dict.remote(self._server_state)),
        )

    def close(self) -> None:
        for actor in [*self.workers, self.server, self.evaluator]:
            if actor is not None:
                with suppress(Exception):
                    ray.kill(actor)
        self.states = {}
        if self._scorer is not None:
            self._scorer.shutdown(wait=True)
            self._scorer = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False


@dataclass
class _Scoring:
    """A deferred evaluation of the server's models: `ref` once submitted."""

    models: Any  # the models to score: an ObjectRef, or the modules (a server in the driver)
    ref: Any = None  # ObjectRef of the score, or the `Future` of the driver's thread scoring it
