"""The client workers' actors (`rayfl.engine.worker.ClientWorker`): how many a run gets
(`plan_workers`), their start (`start_workers`) and the dispatch of a round's clients over them
(`WorkerPool.dispatch`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.autoscaler.sdk import request_resources
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayfl.engine.executor import batches
from rayfl.engine.worker import ClientWorker
from rayfl.errors import UserError
from rayfl.models.families import family_from_config
from rayfl.resources import check_fits, fit_pools, worker_capacity
from rayfl.schema import EngineConfig, Resources, clients_per_round

log = logging.getLogger(__name__)


@dataclass
class WorkerPool:
    """What `start_workers` started: `shapes[i]` is the reservation of `actors[i]`, `shape_of[c]`
    client c's (one pool per resource shape: `engine.resources_by_arch`)."""

    e: EngineConfig
    actors: list[Any]
    shapes: list[Resources]
    shape_of: list[Resources]
    server_options: dict[str, Any]  # where the server actor goes (`pinned`)
    placements: dict[int, int] = field(default_factory=dict)  # client -> worker that last ran it

    def dispatch(
        self,
        round_idx: int,
        order: Sequence[int],
        states: Mapping[int, Any],
        submit: Callable[[Any, list[int], list[Any]], Any],
        record: Callable[[list[int], Any], None],
        deadline: float | None = None,
    ) -> None:
        """Run the clients in `order` in batches of `engine.clients_per_call`, each on whichever
        actor of its clients' shape is free: `submit(actor, batch, their states)` returns the
        call's ObjectRef (or list of them, the first one waited on), `record(batch, it)` takes
        the result. At the `deadline` the calls still running are cancelled and the batches not
        started dropped. A UserError when an actor died more often than Ray re-runs a call."""
        e = self.e
        by_shape: dict[Any, list[int]] = {}
        for c in order:
            by_shape.setdefault(self.shape_of[c], []).append(c)
        size = e.clients_per_call
        pending = {shape: deque(batches(ids, size)) for shape, ids in by_shape.items()}
        idle: dict[Any, deque[int]] = {}
        for index, shape in enumerate(self.shapes):
            idle.setdefault(shape, deque()).append(index)
        running: dict[Any, tuple[int, list[int], Any]] = {}
        while True:
            for shape, queue in pending.items():
                free = idle.get(shape)
                while free and queue:
                    index, batch = free.popleft(), queue.popleft()
                    handle = submit(self.actors[index], batch, [states.get(c) for c in batch])
                    self.placements.update(dict.fromkeys(batch, index))
                    ref = handle[0] if isinstance(handle, list) else handle
                    running[ref] = (index, batch, handle)
            if not running:
                return
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, _ = ray.wait(list(running), num_returns=1, timeout=timeout)
            if not done:
                dropped = len(running) + sum(len(q) for q in pending.values())
                log.warning(
                    "round %d: engine.round_timeout_s=%s passed; %d client batches dropped",
                    *(round_idx, e.round_timeout_s, dropped),
                )
                for ref in running:
                    with suppress(Exception):
                        ray.cancel(ref)
                return
            index, batch, handle = running.pop(done[0])
            try:
                record(batch, handle)
            except ray.exceptions.RayActorError:
                raise UserError(
                    f"round {round_idx}: clients {batch} failed: their worker died "
                    f"{e.max_retries + 1} times; check memory "
                    "(engine.worker_resources) or raise engine.max_retries"
                ) from None
            idle[self.shapes[index]].append(index)


def arch_shapes(e: EngineConfig, archs: Sequence[str]) -> list[Resources]:
    """Each client's worker reservation: its architecture's in `engine.resources_by_arch`, else
    `engine.worker_resources` (`archs[c]` is client c's architecture)."""
    return [e.resources_by_arch.get(a, e.worker_resources) for a in archs]


def start_workers(e: EngineConfig, per_round: int, archs: Sequence[str] = ()) -> WorkerPool:
    """Plan the run's workers and create their actors, without their spec and data (each
    process imports torch meanwhile; the first call sets it up). With
    `engine.resources_by_arch`, `archs` (every client's architecture) decides the pools.

    Ray restarts a worker that dies (`max_restarts=-1`: as often as needed) and re-runs the
    call it was running up to `engine.max_retries` times (`max_task_retries`); a call that
    fails more often surfaces as `RayActorError` (rayfl.engine.ray_executor)."""
    shape_of = arch_shapes(e, archs)
    if e.resources_by_arch:
        sizes = fit_pools(e, per_round, shape_of, ray.cluster_resources())
    else:
        sizes = {e.worker_resources: plan_workers(e, per_round)}
    shapes = [shape for shape, count in sizes.items() for _ in range(count)]
    server = [e.server_resources] if bundle(e.server_resources) else []
    where = pinned([*shapes, *server])
    actors: list[Any] = []
    for shape, options in zip(shapes, where):
        cls = ray.remote(ClientWorker).options(
            num_cpus=shape.num_cpus,
            num_gpus=shape.num_gpus,
            max_restarts=-1,
            max_task_retries=e.max_retries,
            **options,
        )
        actors.append(cls.remote())
    return WorkerPool(e, actors, shapes, shape_of, where[-1] if server else {})


def pinned(requests: Sequence[Resources]) -> list[dict[str, Any]]:
    """Scheduling options that put each actor of `requests` in a bundle of its own, of its own
    shape, when this process runs inside a placement group (a suite run or a sweep trial, whose
    bundles are `rayfl.tune.trial.trial_bundles`: this process's, then one per actor). Left to
    any bundle, Ray may take an actor's CPU from one bundle and its GPU from another, so that no
    bundle still fits the next actor and it waits for ever."""
    pg = get_current_placement_group()
    if pg is None:
        return [{} for _ in requests]
    specs = pg.bundle_specs
    free = list(range(1, len(specs)))  # bundle 0: this process
    out: list[dict[str, Any]] = []
    for res in requests:
        want = bundle(res)
        index = next((i for i in free if _cpu_gpu(specs[i]) == want), None)
        if index is None:
            out.append({})
            continue
        free.remove(index)
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
        out.append({"scheduling_strategy": strategy})
    return out


def _cpu_gpu(spec: Mapping[str, float]) -> dict[str, float]:
    return {k: v for k, v in spec.items() if k in ("CPU", "GPU") and v > 0}


def run_shapes(cfg: Any, total: Mapping[str, float], one_each: bool = False) -> list[Resources]:
    """The reservation of each worker that a run of `cfg` (a `RunConfig` with
    `engine.resources_by_arch`) gets from `total`, one entry per worker; `one_each`: one worker
    per shape unless `engine.num_workers` asks for more (a Tune trial's default)."""
    e = cfg.engine
    archs = family_from_config(cfg.model.family, cfg.model.architectures).assign(
        cfg.data.num_clients, cfg.model.proportions
    )
    shapes = arch_shapes(e, archs)
    if one_each:
        e = dataclasses.replace(e, num_workers=e.num_workers or len(set(shapes)))
    sizes = fit_pools(e, clients_per_round(cfg), shapes, total)
    return [r for r, n in sizes.items() for _ in range(n)]


def bundle(res: Any) -> dict[str, float]:
    """A placement-group bundle of a reservation (`Resources`): its non-zero CPU and GPU."""
    return {k: v for k, v in (("CPU", res.num_cpus), ("GPU", res.num_gpus)) if v > 0}


def wait_for_resources(e: EngineConfig, per_round: int, poll_s: float = 2.0) -> dict[str, float]:
    """On a joined cluster (`engine.address`), ask the autoscaler for the run's workers and
    server and wait up to `engine.wait_for_resources_s` until at least the workers the run needs
    (`engine.num_workers`, else one) fit: GPU nodes of an autoscaling cluster start at zero.
    Returns the cluster's resources; raises UserError when the time runs out."""
    required = e.num_workers or 1
    total = ray.cluster_resources()
    if worker_capacity(e, total) >= required:
        return total
    wanted = max(required, math.ceil(per_round / e.clients_per_call))
    bundles = [bundle(e.worker_resources) for _ in range(wanted)]
    if bundle(e.server_resources):
        bundles.append(bundle(e.server_resources))
    w = e.worker_resources
    need = f"{required} worker(s) of {w.num_cpus:g} CPU / {w.num_gpus:g} GPU"
    request_resources(bundles=bundles)
    log.warning(
        "the cluster has %g CPU / %g GPU, not enough for %s; asked the autoscaler for %d "
        "worker bundles and waiting up to %.0f s (engine.wait_for_resources_s)",
        total.get("CPU", 0.0),
        total.get("GPU", 0.0),
        need,
        wanted,
        e.wait_for_resources_s,
    )
    start = time.monotonic()
    next_note = start + 60.0
    while time.monotonic() - start < e.wait_for_resources_s:
        time.sleep(min(poll_s, max(0.0, e.wait_for_resources_s - (time.monotonic() - start))))
        total = ray.cluster_resources()
        if worker_capacity(e, total) >= required:
            log.warning(
                "resources arrived after %.0f s: %g CPU / %g GPU",
                time.monotonic() - start,
                total.get("CPU", 0.0),
                total.get("GPU", 0.0),
            )
            return total
        if time.monotonic() >= next_note:
            log.warning("still waiting for %s (%.0f s so far)", need, time.monotonic() - start)
            next_note += 60.0
    raise UserError(
        f"waited engine.wait_for_resources_s={e.wait_for_resources_s:g} s for {need} but the "
        f"cluster has {total.get('CPU', 0.0):g} CPU / {total.get('GPU', 0.0):g} GPU; check the "
        "autoscaler (`ray status`, `ray monitor cluster.yaml`), raise engine.wait_for_resources_s "
        "or lower engine.worker_resources"
    )


def plan_workers(e: EngineConfig, per_round: int) -> int:
    """How many workers fit the cluster with `engine.worker_resources` (after the server's share).
    On a joined cluster it first waits for the autoscaler (see `wait_for_resources`)."""
    if e.address and e.wait_for_resources_s > 0:
        total = wait_for_resources(e, per_round)
    else:
        total = ray.cluster_resources()
    capacity = check_fits(e, total)
    wanted = e.num_workers or math.ceil(per_round / e.clients_per_call)
    return max(1, min(wanted, capacity))
