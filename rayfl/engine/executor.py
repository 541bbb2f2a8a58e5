"""Executors: where clients train and the server runs. Both run the same runners.

`SerialExecutor` runs everything in this process (debugging, tiny tests). `RayExecutor` runs a
pool of long-lived `ClientWorker` actors with fractional CPU/GPU reservations, and the server half
in the driver or in a `ServerActor` (`engine.server_in`); client state stays in Ray's object store
as references the driver owns, never in its heap.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext, suppress
from dataclasses import dataclass
from typing import Any

import ray

from rayfl.algorithms.base import Payload
from rayfl.config import EngineConfig, server_in_driver
from rayfl.data.federated import Federation
from rayfl.engine.background import Background
from rayfl.engine.pool import ClientWorker, WorkerPool, start_workers
from rayfl.engine.server import ServerActor, ServerEvaluator, ServerRunner
from rayfl.engine.spec import RunSpec, resolve_device
from rayfl.engine.startup import StartupClock, init_ray_for_run, shutdown_ray
from rayfl.engine.worker import ClientMetrics, ClientRunner
from rayfl.errors import UserError

log = logging.getLogger(__name__)


class Executor(ABC):
    """The primitives the round loop calls. Handles are values (serial) or ObjectRefs (Ray)."""

    spec: RunSpec
    # Optional listener of progress inside a round: `progress(phase, done, total)`, phase "fit"
    # or "eval", after each batch of clients (the terminal progress bar sets it).
    progress: Callable[[str, int, int], None] | None = None

    def _report(self, phase: str, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(phase, done, total)

    @abstractmethod
    def broadcast(
        self, round_idx: int, archs: Sequence[str]
    ) -> tuple[dict[str, int], dict[str, Any]]:
        """Payload sizes and handles, one per architecture among this round's clients."""

    @abstractmethod
    def fit(
        self, round_idx: int, client_ids: Sequence[int], payloads: dict[str, Any], evaluate: bool
    ) -> tuple[list[ClientMetrics], list[Any]]:
        """Train the clients; returns their metrics and handles of their reply lists."""

    @abstractmethod
    def evaluate(
        self, round_idx: int, client_ids: Sequence[int], payloads: dict[str, Any]
    ) -> list[ClientMetrics]:
        """Score every client's deployed model given the server's new broadcast (`payloads`, one
        per architecture among `client_ids`); client states are read, never changed."""

    @abstractmethod
    def server_step(
        self, round_idx: int, replies: list[Any], evaluate: bool
    ) -> dict[str, float]: ...

    @abstractmethod
    def server_state(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_server_state(self, state: dict[str, Any]) -> None: ...

    @abstractmethod
    def client_states(self, client_ids: Sequence[int]) -> Iterator[tuple[int, Payload]]:
        """Yield `(client id, state)` one at a time (checkpoints stream them to disk)."""

    @abstractmethod
    def load_client_state(self, client_id: int, state: Payload) -> None: ...

    def server_step_deferred(
        self, round_idx: int, replies: list[Any], evaluate: bool, final: bool = False
    ) -> tuple[dict[str, float], Any]:
        """The server step without its evaluation, and a handle for `collect_eval`, so that the
        evaluation (which feeds no broadcast) can run while the next round's clients train, or,
        after the `final` round, while the clients evaluate."""
        return self.server_step(round_idx, replies, evaluate), None

    def collect_eval(self, handle: Any) -> dict[str, float]:
        """The metrics of a deferred evaluation (waits for it)."""
        return {}

    def snapshot(self) -> Any:
        """The client and server states now, unaffected by later rounds (for checkpoints). An
        executor that cannot freeze them returns itself, and the loop then does not pipeline."""
        return self

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release workers and the server."""


class StateView:
    """States at the end of one round, as handles (values or ObjectRefs) resolved by `get`: what
    a checkpoint reads (`client_states`, `server_state`) while the next round already runs."""

    def __init__(self, clients: dict[int, Any], server: Any, get: Callable[[Any], Any]) -> None:
        self._clients = clients
        self._server = server
        self._get = get

    def client_states(self, client_ids: Sequence[int]) -> Iterator[tuple[int, Payload]]:
        for c in client_ids:
            if c in self._clients:
                yield c, self._get(self._clients[c])

    def server_state(self) -> dict[str, Any]:
        return self._get(self._server)


def _batches(ids: Sequence[int], size: int) -> list[list[int]]:
    return [list(ids[i : i + size]) for i in range(0, len(ids), size)]


def longest_first(
    ids: Sequence[int], sizes: Sequence[int], archs: Sequence[str] | None = None
) -> list[int]:
    """`ids` ordered for dispatch to whichever worker is free: most samples first, so that the
    round ends on the shortest calls and no worker waits long for another (longest processing
    time first: within 1% of a perfect split on the benchmark partition, against 10% in id
    order). With `archs` (grouped training), clients of one architecture stay together, so a
    call can batch them. The numbers do not depend on the order: every client is seeded on its
    own, and the server and the metrics sort by client id."""
    if archs is None:
        return sorted(ids, key=lambda c: (-sizes[c], c))
    return sorted(ids, key=lambda c: (archs[c], -sizes[c], c))


class SerialExecutor(Executor):
    # The clock of the round deadline (a test replaces it by a fake one).
    clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, spec: RunSpec, federation: Federation) -> None:
        self.spec = spec
        device = resolve_device(spec.device)
        self.runner = ClientRunner(spec, federation, device)
        self.server = ServerRunner(spec, federation, device)
        self.states: dict[int, Payload] = {}

    def broadcast(
        self, round_idx: int, archs: Sequence[str]
    ) -> tuple[dict[str, int], dict[str, Any]]:
        sizes, payloads = self.server.broadcast(round_idx, archs)
        return sizes, dict(zip(archs, payloads))

    def fit(
        self, round_idx: int, client_ids: Sequence[int], payloads: dict[str, Any], evaluate: bool
    ) -> tuple[list[ClientMetrics], list[Any]]:
        timeout = self.spec.engine.round_timeout_s
        if timeout is None:
            # the batches a Ray worker would get (each client is seeded on its own, so the
            # numbers are those of one call); a grouped round stays one computation
            e = self.spec.engine
            size = len(client_ids) if e.grouped else e.clients_per_call
            rows, reply_lists = [], []
            for chunk in _batches(client_ids, max(1, size)):
                states = [self.states.get(c) for c in chunk]
                chunk_rows, batch, new_states = self.runner.fit(
                    round_idx, chunk, payloads, states, evaluate
                )
                self.states.update(zip(chunk, new_states))
                rows += chunk_rows
                reply_lists.append(batch)
                self._report("fit", len(rows), len(client_ids))
            return rows, reply_lists
        # With a deadline, clients train one at a time (each is seeded on its own, so the numbers
        # are those of one call) and the ones not started when it passes are dropped, as on Ray.
        deadline = self.clock() + timeout
        metrics: list[ClientMetrics] = []
        replies: list[Any] = []
        for i, cid in enumerate(client_ids):
            if self.clock() > deadline:
                log.warning(
                    "round %d: deadline engine.round_timeout_s=%s passed; %d clients dropped",
                    round_idx,
                    timeout,
                    len(client_ids) - i,
                )
                break
            m, r, new = self.runner.fit(
                round_idx, [cid], payloads, [self.states.get(cid)], evaluate
            )
            metrics += m
            replies += r
            self.states[cid] = new[0]
            self._report("fit", i + 1, len(client_ids))
        return metrics, [replies]

    def evaluate(
        self, round_idx: int, client_ids: Sequence[int], payloads: dict[str, Any]
    ) -> list[ClientMetrics]:
        rows: list[ClientMetrics] = []
        for chunk in _batches(client_ids, self.spec.engine.clients_per_call):
            states = [self.states.get(c) for c in chunk]
            rows += self.runner.evaluate(round_idx, chunk, payloads, states)
            self._report("eval", len(rows), len(client_ids))
        return rows

    def server_step(self, round_idx: int, replies: list[Any], evaluate: bool) -> dict[str, float]:
        return self.server.step(round_idx, replies, evaluate)

    def server_step_deferred(
        self, round_idx: int, replies: list[Any], evaluate: bool, final: bool = False
    ) -> tuple[dict[str, float], Any]:
        return self.server.step_deferred(round_idx, replies, evaluate)

    def collect_eval(self, handle: Any) -> dict[str, float]:
        return self.server.score(handle) if handle else {}

    def snapshot(self) -> StateView:
        # states are replaced, never changed in place: a shallow copy is a snapshot
        return StateView(dict(self.states), self.server.state_dict(), lambda v: v)

    def server_state(self) -> dict[str, Any]:
        return self.server.state_dict()

    def load_server_state(self, state: dict[str, Any]) -> None:
        self.server.load_state_dict(state)

    def client_states(self, client_ids: Sequence[int]) -> Iterator[tuple[int, Payload]]:
        for c in client_ids:
            if c in self.states:
                yield c, self.states[c]

    def load_client_state(self, client_id: int, state: Payload) -> None:
        self.states[client_id] = state


def ray_get(refs: Any, timeout: float | None = None) -> Any:
    """`ray.get` that re-raises a user error raised inside an actor as itself (its one line),
    not wrapped in Ray's `RayTaskError` with the remote traceback."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, UserError):
            raise exc.cause from None
        raise


def _value_or_get(handle: Any) -> Any:
    return ray_get(handle) if isinstance(handle, ray.ObjectRef) else handle


class RayExecutor(Executor):
    """Workers on Ray; the server in the driver (`local`, a `ServerRunner`) or in a server actor,
    with an evaluation actor for its pipelined scoring. Built in two steps so that start-up
    overlaps (`rayfl.engine.startup.EarlyRay`): `launch` (Ray, actor processes; needs no data) and
    `attach` (dataset put once, spec and data to every actor).

    In the driver, the server costs no process of its own (on a 2-core machine a third process
    importing torch delays the workers' start by ~1 s), its broadcast is put once per round, its
    replies are read zero-copy, and its models are scored in a thread (`Background`) while the
    clients train or evaluate. It cannot die on its own, so it has no restart path."""

    def __init__(self, spec: RunSpec, federation: Federation) -> None:
        self.launch(spec.engine, spec.per_round)
        self.attach(spec, federation)

    def launch(
        self,
        e: EngineConfig,
        per_round: int,
        clock: StartupClock | None = None,
        started_ray: bool | None = None,
        pool: WorkerPool | None = None,
    ) -> None:
        """Start Ray (unless it runs; `started_ray`: the caller did, True if it started it) and
        the actors' processes, which import torch meanwhile (`pool`: the workers' actors, when
        the caller started them: `rayfl.engine.startup.EarlyRay`; they are this executor's
        from here, closed with it)."""
        self._started_ray = False
        self.after_shutdown: Callable[[], None] = getattr(self, "after_shutdown", lambda: None)
        self.workers: list[Any] = list(pool.actors) if pool is not None else []
        self.server: Any = None
        self.local: ServerRunner | None = None  # the server half, when it runs in the driver
        self._server_ready: Any = None
        self.evaluator: Any = None
        self._final_scoring: _Scoring | None = None
        self.states: dict[int, ray.ObjectRef] = {}
        # The server state after the last finished server step, as an object the driver owns
        # (it outlives the server actor): a restarted server starts from it. None: a fresh server
        # is identical (it is built from the seed).
        self._server_state: Any = None
        if started_ray is None:
            with _phase(clock, "ray_start"):
                started_ray = init_ray_for_run(e)
        self._started_ray = started_ray
        self.driver: ClientWorker | None = None  # the driver's own worker (`driver_trains`)
        self._starting: list[Any] = []  # the actors' setup calls, awaited by the first round's
        self._clock = clock
        try:
            with _phase(clock if pool is None else None, "actors_launch"):
                if pool is None:
                    pool = start_workers(e, per_round, started_ray)
                self.num_workers, self._driver_trains = pool.num_workers, pool.driver_trains
                self._worker_cls, self.workers = pool.cls, pool.actors
                self._server_cls: Any = ray.remote(ServerActor).options(
                    num_cpus=e.server_resources.num_cpus, num_gpus=e.server_resources.num_gpus
                )
                if not server_in_driver(e):  # else `attach` builds `local`
                    self.server = self._server_cls.remote()
                # No CPU of its own, like the server: it fills the time workers spend off the CPU.
                # Started when first needed (`server_step_deferred`), not in the start-up.
                self._evaluator_cls: Any = ray.remote(ServerEvaluator).options(
                    num_cpus=0, num_gpus=0
                )
        except BaseException:
            self.close()
            raise

    def attach(
        self, spec: RunSpec, federation: Federation, clock: StartupClock | None = None
    ) -> None:
        """Put the dataset once (every actor maps it zero-copy) and set every actor up."""
        self.spec = spec
        self._clock = clock or self._clock
        self._train_sizes = [len(c.train) for c in federation.clients]
        self._test_sizes = [len(c.test) for c in federation.clients]
        try:
            with _phase(clock, "dataset_put"):
                self._federation_ref = ray.put(federation)
            actors = [*self.workers, *([self.server] if self.server is not None else [])]
            actors += [self.evaluator] if self.evaluator is not None else []
            ready = [a.setup.remote(spec, self._federation_ref) for a in actors]
            if self.server is not None:
                # the server answers through its setup, the workers through info() after theirs
                self._server_ready = ready[len(self.workers)]
            else:  # built while the workers' processes import torch
                self.local = ServerRunner(spec, federation, resolve_device(spec.device, []))
            if self._driver_trains:
                self.driver = ClientWorker(spec, federation)
            if self.driver is not None and self.server is None:
                # The driver starts training at once; the actors join the first round once they
                # answer (`_await_ready`, in the round's actor lane).
                self._starting = ready
            else:
                self._await_ready(ready)
        except BaseException:
            self.close()
            raise
        log.info(
            "Ray executor: %d workers%s",
            self.num_workers,
            " (the driver is one of them)" if self.driver is not None else "",
        )

    def _await_ready(self, ready: list[Any]) -> None:
        """Wait for the actors' setup calls `ready`: a setup error (e.g. no GPU) surfaces here,
        as itself; actors that died are replaced; a start past `engine.startup_timeout_s` is a
        UserError."""
        with _phase(self._clock, "actors_ready"):
            deadline = time.monotonic() + self.spec.engine.startup_timeout_s
            for ref in ready:
                with suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    ray_get(ref, timeout=max(0.0, deadline - time.monotonic()))
            self._await_started()  # replaces actors that died; times out with a message

    def _new_server(self) -> None:
        with suppress(Exception):
            if self.server is not None:
                ray.kill(self.server)
        server: Any = self._server_cls.remote(self.spec, self._federation_ref)
        self.server = server
        self._server_ready = (
            server.load_state_dict.remote(self._server_state)
            if self._server_state is not None
            else server.device.remote()
        )

    def _await_started(self) -> None:
        """Wait until every worker and the server answer; replace those that die meanwhile.

        Raises:
            UserError: they did not answer within `engine.startup_timeout_s`, or kept dying.
        """
        e = self.spec.engine
        deadline = time.monotonic() + e.startup_timeout_s
        for _ in range(e.max_retries + 1):
            probes: list[tuple[Any, int]] = [
                (w.info.remote(), i) for i, w in enumerate(self.workers)
            ]
            if self._server_ready is not None:
                probes.append((self._server_ready, -1))
            dead = []
            for ref, who in probes:
                try:
                    ray_get(ref, timeout=max(0.0, deadline - time.monotonic()))
                except ray.exceptions.GetTimeoutError:
                    raise UserError(
                        f"the Ray workers and server did not start within "
                        f"engine.startup_timeout_s={e.startup_timeout_s:g} s (the cluster lacks "
                        "free resources or is overloaded; `ray status` shows them); raise "
                        "engine.startup_timeout_s or lower engine.num_workers / engine.worker_resources"
                    ) from None
                except ray.exceptions.RayActorError:
                    dead.append(who)
            if not dead:
                self._server_ready = None
                return
            log.warning("%d actors died while starting; replacing them", len(dead))
            for who in dead:
                if who < 0:
                    self._new_server()
                else:
                    self.workers[who] = self._new_worker()
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

    def _new_worker(self) -> Any:
        return self._worker_cls.remote(self.spec, self._federation_ref)

    def worker_info(self) -> list[dict[str, Any]]:
        """The actors' `ClientWorker.info` (the driver's own worker, when it trains, is not one)."""
        self._actors_started()
        return ray.get([w.info.remote() for w in self.workers])

    def _actors_started(self) -> None:
        """Await the actors' start if `attach` left it to the first round (`_starting`)."""
        if self._starting:
            starting, self._starting = self._starting, []
            self._await_ready(starting)

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
            return ray_get(refs[0]), dict(zip(archs, refs[1:]))

        return self._with_server("broadcast", call)

    def fit(
        self, round_idx: int, client_ids: Sequence[int], payloads: dict[str, Any], evaluate: bool
    ) -> tuple[list[ClientMetrics], list[Any]]:
        e = self.spec.engine
        order = longest_first(client_ids, self._train_sizes, self.spec.archs if e.grouped else None)
        retries: dict[tuple[int, ...], int] = {}
        metrics: list[ClientMetrics] = []
        reply_refs: list[Any] = []

        def submit(slot: int, batch: list[int]) -> tuple[Any, Any]:
            states = [self.states.get(c) for c in batch]
            refs = (
                self.workers[slot]
                .fit.options(num_returns=2 + len(batch))
                .remote(round_idx, batch, payloads, evaluate, *states)
            )
            return refs[0], refs

        def finish(batch: list[int], refs: Any) -> tuple[Any, ...]:
            return ray_get(refs[0]), refs[1], refs[2:]

        def in_driver(batch: list[int]) -> tuple[Any, ...]:
            assert self.driver is not None
            rows, replies, *states = self.driver.fit(
                round_idx, batch, payloads, evaluate, *self._resolved(batch)
            )
            return rows, ray.put(replies), [ray.put(state) for state in states]

        def record(batch: list[int], result: tuple[Any, ...]) -> None:
            rows, replies, states = result
            metrics.extend(rows)
            reply_refs.append(replies)
            self.states.update(zip(batch, states))
            self._report("fit", len(metrics), len(client_ids))

        def died(batch: list[int]) -> None:
            key = tuple(batch)
            retries[key] = retries.get(key, 0) + 1
            if retries[key] > e.max_retries:
                raise UserError(
                    f"round {round_idx}: clients {batch} failed {retries[key]} times (worker died); "
                    "check memory (engine.worker_resources) or raise engine.max_retries"
                )
            log.warning(
                "round %d: a worker died; retrying clients %s on a new worker", round_idx, batch
            )

        deadline = None if e.round_timeout_s is None else time.monotonic() + e.round_timeout_s
        self._dispatch(
            round_idx,
            _batches(order, e.clients_per_call),
            _Lane(submit, finish, in_driver, record, died),
            deadline,
        )
        return metrics, reply_refs

    def evaluate(
        self, round_idx: int, client_ids: Sequence[int], payloads: dict[str, Any]
    ) -> list[ClientMetrics]:
        """Batches of `engine.clients_per_call` clients, handed to whichever worker is free; the
        states travel as object references (the driver never holds them). Evaluation changes no
        state, so a batch whose worker died simply runs again on a new worker."""
        e = self.spec.engine
        order = longest_first(client_ids, self._test_sizes)
        failures = 0
        rows: list[ClientMetrics] = []

        def submit(slot: int, batch: list[int]) -> tuple[Any, Any]:
            states = [self.states.get(c) for c in batch]
            ref = self.workers[slot].evaluate.remote(round_idx, batch, payloads, *states)
            return ref, ref

        def in_driver(batch: list[int]) -> list[ClientMetrics]:
            assert self.driver is not None
            return self.driver.evaluate(round_idx, batch, payloads, *self._resolved(batch))

        def died(batch: list[int]) -> None:
            nonlocal failures
            failures += 1
            if failures > e.max_retries:
                raise UserError(
                    f"round {round_idx}: evaluation failed {failures} times (worker died); "
                    "check memory (engine.worker_resources) or raise engine.max_retries"
                )
            log.warning("round %d: a worker died in evaluation; retrying %s", round_idx, batch)

        def record(batch: list[int], result: list[ClientMetrics]) -> None:
            rows.extend(result)
            self._report("eval", len(rows), len(client_ids))

        lane = _Lane(submit, lambda _, ref: ray_get(ref), in_driver, record, died)
        self._dispatch(round_idx, _batches(order, e.clients_per_call), lane)
        return rows

    def _resolved(self, batch: list[int]) -> list[Payload | None]:
        """The states of `batch` as values, as an actor receives them (for the driver's worker)."""
        refs = [self.states[c] for c in batch if c in self.states]
        values = iter(ray.get(refs) if refs else [])
        return [next(values) if c in self.states else None for c in batch]

    def _dispatch(
        self, round_idx: int, batches: list[list[int]], lane: _Lane, deadline: float | None = None
    ) -> None:
        """Run `batches`, each on whichever worker is free: the actors, through Ray, and the
        driver's own worker when it trains (`engine.driver_trains`), in this thread while a
        second one feeds the actors. A batch whose actor died runs again on a new actor
        (`lane.died` raises when that is once too often); at the `deadline` the actors' calls are
        cancelled and the batches not started are dropped.

        The driver's worker takes one client at a time from the front batch (a whole batch with
        `engine.grouped`, which trains it as one computation): it pays no call per batch, and
        the round ends within one small client of the actors' last call, not within a batch
        of them. Which worker trains a client never changes its numbers."""
        queue = _Queue(batches)
        if self.driver is None:
            self._actor_lane(round_idx, queue, lane, deadline)
            return
        actors = Background(self._actor_lane, round_idx, queue, lane, deadline, name="rayfl-lane")
        one = None if self.spec.engine.grouped else 1
        try:
            while (batch := queue.take(one)) is not None:
                result = lane.in_driver(batch)
                with queue.lock:
                    lane.record(batch, result)
        except BaseException:
            queue.stop()  # the actors take nothing more; their calls end with the executor
            raise
        actors.result()

    def _actor_lane(
        self, round_idx: int, queue: _Queue, lane: _Lane, deadline: float | None
    ) -> None:
        self._actors_started()  # the first round's: the driver trained meanwhile
        idle = deque(range(len(self.workers)))
        running: dict[Any, tuple[int, list[int], Any]] = {}
        try:
            while True:
                while idle and (batch := queue.take()) is not None:
                    slot = idle.popleft()
                    ref, handle = lane.submit(slot, batch)
                    running[ref] = (slot, batch, handle)
                if not running:
                    return
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                done, _ = ray.wait(list(running), num_returns=1, timeout=timeout)
                if not done:
                    log.warning(
                        "round %d: deadline engine.round_timeout_s=%s passed; %d client batches "
                        "dropped",
                        round_idx,
                        self.spec.engine.round_timeout_s,
                        len(running) + queue.stop(),
                    )
                    for ref in running:
                        with suppress(Exception):
                            ray.cancel(ref)
                    return
                slot, batch, handle = running.pop(done[0])
                try:
                    result = lane.finish(batch, handle)
                except ray.exceptions.RayActorError:
                    result = _DIED
                if result is _DIED:
                    lane.died(batch)  # raises when the batch failed once too often
                    self.workers[slot] = self._new_worker()
                    queue.put_back(batch)
                    idle.append(slot)
                    continue
                with queue.lock:
                    lane.record(batch, result)
                idle.append(slot)
        except BaseException:
            queue.stop()  # the driver's worker takes nothing more either
            raise

    def server_step(self, round_idx: int, replies: list[Any], evaluate: bool) -> dict[str, float]:
        if self.local is not None:
            return self.local.step(round_idx, ray_get(replies), evaluate)

        # The replies are objects the driver owns: a restarted server steps on the same ones.
        def call() -> dict[str, float]:
            metrics, state = self.server.step_and_state.options(num_returns=2).remote(
                round_idx, evaluate, *replies
            )
            out = ray_get(metrics)
            self._server_state = state
            return out

        return self._with_server(f"round {round_idx}", call)

    def server_step_deferred(
        self, round_idx: int, replies: list[Any], evaluate: bool, final: bool = False
    ) -> tuple[dict[str, float], Any]:
        """The step now, its models scored meanwhile: by the evaluation actor (started on first
        use) while the next round's clients train, or, in the `final` round, by the server
        itself, idle from then on, while the clients evaluate."""
        if not self.spec.engine.pipeline_eval:
            return self.server_step(round_idx, replies, evaluate), None
        if self.local is not None:  # scored in a thread of this process, not by an actor
            out, models = self.local.step_deferred(round_idx, ray_get(replies), evaluate)
            if not evaluate:
                return out, None
            if final:  # started after the deployed evaluation's broadcast, as on an actor
                self._final_scoring = _Scoring(models)
                return out, self._final_scoring
            return out, _Scoring(models, self._score_in_driver(models))

        def call() -> tuple[dict[str, float], Any]:
            metrics, state, models = self.server.step_deferred.options(num_returns=3).remote(
                round_idx, evaluate, *replies
            )
            out = ray_get(metrics)
            self._server_state = state
            if not evaluate:
                return out, None
            if final:  # submitted after the deployed evaluation's broadcast (`broadcast`)
                self._final_scoring = _Scoring(models)
                return out, self._final_scoring
            if self.evaluator is None:
                self.evaluator = self._new_evaluator()
            return out, _Scoring(models, self.evaluator.score.remote(models))

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

    def _score_in_driver(self, models: Any) -> Background:
        """The server's models scored by a thread of this process (the server runs here)."""
        assert self.local is not None
        return Background(self.local.score, models, name="rayfl-score")

    def collect_eval(self, handle: Any) -> dict[str, float]:
        if handle is None:
            return {}
        if handle.ref is None:  # the last round's, with no broadcast after it
            self._start_final_scoring()
        if isinstance(handle.ref, Background):
            return handle.ref.result()
        try:
            return ray_get(handle.ref)
        except ray.exceptions.RayActorError:
            log.warning("the actor scoring the server's models died; scoring them again")
            self.evaluator = self._new_evaluator()
            return ray_get(self.evaluator.score.remote(handle.models))

    def snapshot(self) -> StateView:
        if self.local is not None:  # state_dict() is a fresh copy, as for the serial executor
            return StateView(dict(self.states), self.local.state_dict(), _value_or_get)
        return StateView(dict(self.states), self._server_state, ray_get)

    def _new_evaluator(self) -> Any:
        return self._evaluator_cls.remote(self.spec, self._federation_ref)

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

    def client_states(self, client_ids: Sequence[int]) -> Iterator[tuple[int, Payload]]:
        for c in client_ids:
            if c in self.states:
                yield c, ray.get(self.states[c])

    def load_client_state(self, client_id: int, state: Payload) -> None:
        self.states[client_id] = ray.put(state)

    def close(self) -> None:
        actors = [*getattr(self, "workers", []), getattr(self, "server", None)]
        for actor in [*actors, getattr(self, "evaluator", None)]:
            if actor is not None:
                with suppress(Exception):
                    ray.kill(actor)
        self.states = {}
        if self._started_ray:
            shutdown_ray()
            self._started_ray = False
            self.after_shutdown()


_DIED = object()  # `_actor_lane`: the call's actor died


@dataclass
class _Lane:
    """How `RayExecutor._dispatch` runs one kind of call: `submit(slot, batch)` to an actor
    (its ObjectRef to wait on and a handle), `finish(batch, handle)` its result (raises
    RayActorError when the actor died), `in_driver(batch)` the same call on the driver's worker,
    `record(batch, result)` (called under the queue's lock), `died(batch)` on a dead actor."""

    submit: Callable[[int, list[int]], tuple[Any, Any]]
    finish: Callable[[list[int], Any], Any]
    in_driver: Callable[[list[int]], Any]
    record: Callable[[list[int], Any], None]
    died: Callable[[list[int]], None]


class _Queue:
    """A round's batches, taken by whichever worker is free (the actors' lane and the driver's),
    longest first; `stop` empties it."""

    def __init__(self, batches: list[list[int]]) -> None:
        self.lock = threading.Lock()
        self._pending = deque(batches)

    def take(self, most: int | None = None) -> list[int] | None:
        """The front batch, or its first `most` clients (the rest stays in front)."""
        with self.lock:
            if not self._pending:
                return None
            front = self._pending[0]
            if most is None or len(front) <= most:
                return self._pending.popleft()
            self._pending[0] = front[most:]
            return front[:most]

    def put_back(self, batch: list[int]) -> None:
        with self.lock:
            self._pending.appendleft(batch)

    def stop(self) -> int:
        """Drop the batches not taken; returns how many."""
        with self.lock:
            dropped = len(self._pending)
            self._pending.clear()
            return dropped


@dataclass
class _Scoring:
    """A deferred evaluation of the server's models: `ref` once submitted."""

    models: Any  # the models to score: an ObjectRef, or the modules (a server in the driver)
    ref: Any = None  # ObjectRef of the score, or the `Background` scoring it in the driver


def _phase(clock: StartupClock | None, name: str) -> AbstractContextManager[None]:
    return nullcontext() if clock is None else clock.phase(name)


def make_executor(spec: RunSpec, federation: Federation) -> Executor:
    if spec.engine.executor == "serial":
        return SerialExecutor(spec, federation)
    return RayExecutor(spec, federation)
