"""Whether a run's workers and server fit the CPUs and GPUs they would be placed on, without Ray.

One set of rules and messages for the engine once Ray is up (`ray.cluster_resources()`), the
config check (`engine.ray_num_cpus`), `rayfl validate --cluster` (a launcher file at its
maximum size) and `rayfl run` before it starts a private Ray (this machine).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from rayfl.errors import UserError, require

if TYPE_CHECKING:
    from rayfl.clusterconfig import ClusterSize
    from rayfl.schema import EngineConfig, Resources

LOWER_WORKERS = "lower engine.worker_resources (e.g. num_gpus=0 on a machine without GPUs)"
GPU_CLUSTER = (
    "run it on a GPU cluster (engine.address=...; check the config against the cluster with "
    "`rayfl validate CONFIG --cluster cluster.yaml`) or set the num_gpus to 0"
)


def worker_capacity(e: EngineConfig, total: Mapping[str, float]) -> int:
    """Workers with `engine.worker_resources` that fit `total` after the server's share (0 when
    not even the server fits); an infinite resource is not counted."""
    cpus, gpus = total.get("CPU", 0.0), total.get("GPU", 0.0)
    w, s = e.worker_resources, e.server_resources
    if s.num_cpus > cpus or s.num_gpus > gpus:
        return 0
    fits = []
    for asked, have, reserved in ((w.num_cpus, cpus, s.num_cpus), (w.num_gpus, gpus, s.num_gpus)):
        if asked > 0 and math.isfinite(have):
            fits.append(math.floor((have - reserved) / asked + 1e-9))
    return max(0, min(fits, default=sys.maxsize))


def _check_server(e: EngineConfig, total: Mapping[str, float], where: str, fix: str) -> str:
    """Refuse a server that does not fit `total`; returns "`where` has N CPU / M GPU"."""
    cpus, gpus = total.get("CPU", 0.0), total.get("GPU", 0.0)
    s = e.server_resources
    has = f"{where} has {cpus:g} CPU" + (f" / {gpus:g} GPU" if math.isfinite(gpus) else "")
    if s.num_cpus > cpus or s.num_gpus > gpus:
        raise UserError(
            f"engine.server_resources asks for {s.num_cpus} CPU / {s.num_gpus} GPU but {has}; "
            f"lower engine.server_resources{' or ' + fix if s.num_gpus > gpus else ''}"
        )
    return has


def check_fits(
    e: EngineConfig,
    total: Mapping[str, float],
    where: str = "the cluster",
    fix: str = LOWER_WORKERS,
) -> int:
    """How many workers fit `total` (the CPUs and GPUs of `where`) after the server's share; a
    UserError when the server, one worker, or the pinned `engine.num_workers` do not fit."""
    w, s = e.worker_resources, e.server_resources
    has = _check_server(e, total, where, fix)
    capacity = worker_capacity(e, total)
    if capacity < 1:
        raise UserError(
            f"engine.worker_resources asks for {w.num_cpus} CPU / {w.num_gpus} GPU per worker "
            f"but {has} (server takes {s.num_cpus:g} / {s.num_gpus:g}); {fix}"
        )
    if e.num_workers and e.num_workers > capacity:
        raise UserError(
            f"engine.num_workers={e.num_workers} workers need more than {has} (room for "
            f"{capacity}); lower engine.num_workers or engine.worker_resources"
        )
    return capacity


def fit_pools(
    e: EngineConfig,
    per_round: int,
    client_shapes: Sequence[Resources],
    total: Mapping[str, float],
    where: str = "the cluster",
) -> dict[Resources, int]:
    """Workers per resource shape (`engine.resources_by_arch`): one per shape first, then more
    in turn, each shape up to its share (by clients) of one wave of a round's clients (or of
    `engine.num_workers`, never more in all), while `total` holds them after the server's; a
    UserError when the server, or one worker of every shape, does not fit."""
    counts = Counter(client_shapes)
    order = list(dict.fromkeys(client_shapes))  # first appearance: the same on every call
    has = _check_server(e, total, where, LOWER_WORKERS)
    s = e.server_resources
    free = {"CPU": total.get("CPU", 0.0) - s.num_cpus, "GPU": total.get("GPU", 0.0) - s.num_gpus}
    wanted_all = e.num_workers or math.ceil(per_round / e.clients_per_call)
    n = max(1, len(client_shapes))
    wanted = {r: max(1, round(wanted_all * counts[r] / n)) for r in order}
    sizes = dict.fromkeys(order, 0)

    def take(r: Resources) -> bool:
        if r.num_cpus > free["CPU"] + 1e-9 or r.num_gpus > free["GPU"] + 1e-9:
            return False
        free["CPU"] -= r.num_cpus
        free["GPU"] -= r.num_gpus
        sizes[r] += 1
        return True

    for r in order:
        if not take(r):
            raise UserError(
                f"engine.resources_by_arch: a worker of {r.num_cpus:g} CPU / {r.num_gpus:g} GPU "
                f"does not fit beside one worker of each other shape and the server ({has}); "
                "lower the reservations in engine.resources_by_arch / engine.worker_resources"
            )
    grew = True
    while grew:
        grew = False
        for r in order:
            if e.num_workers and sum(sizes.values()) >= e.num_workers:
                return sizes
            if sizes[r] < wanted[r] and take(r):
                grew = True
    return sizes


def shapes(e: EngineConfig) -> list[tuple[str, Resources]]:
    """Every reservation under its key: the workers', the server's, each architecture pool's."""
    return [
        ("worker_resources", e.worker_resources),
        ("server_resources", e.server_resources),
        *((f"resources_by_arch.{a}", r) for a, r in e.resources_by_arch.items()),
    ]


def check_shapes(e: EngineConfig, total: Mapping[str, float], where: str) -> None:
    """`check_fits` for each worker shape alone (`fit_pools` shares `total` once Ray runs)."""
    if not e.resources_by_arch:
        check_fits(e, total, where=where)
        return
    for shape in dict.fromkeys([e.worker_resources, *e.resources_by_arch.values()]):
        check_fits(dataclasses.replace(e, worker_resources=shape, num_workers=None), total, where)


def check_engine(e: EngineConfig) -> None:
    """The config's rules for reservations (every number is >= 0 already, `rayfl.config`), and
    a private Ray of `engine.ray_num_cpus` CPUs hosts the server and one worker (all pinned
    `engine.num_workers`); GPUs depend on the machine (`check_local`)."""
    for name, res in shapes(e):
        for attr in ("num_cpus", "num_gpus"):
            value = getattr(res, attr)
            require(
                value <= 1 or float(value).is_integer(),
                f"engine.{name}.{attr}",
                f"fractions above 1 must be whole numbers (got {value})",
            )
    for name, res in shapes(e):
        require(
            name == "server_resources" or res.num_cpus > 0 or res.num_gpus > 0,
            f"engine.{name}",
            "a worker must reserve some CPU or GPU",
        )
    require(
        e.server_in != "driver"
        or (e.server_resources.num_cpus == 0 and e.server_resources.num_gpus == 0),
        "engine.server_in",
        "driver runs the server in the driver's process, which reserves nothing; set "
        "engine.server_resources to 0 CPU / 0 GPU, or use engine.server_in=actor",
    )
    if e.executor != "ray" or e.address or e.ray_num_cpus is None:
        return
    check_fits(
        e,
        {"CPU": float(e.ray_num_cpus), "GPU": math.inf},
        where=f"engine.ray_num_cpus={e.ray_num_cpus} (the private Ray's CPUs)",
        fix="raise engine.ray_num_cpus or lower engine.worker_resources.num_cpus",
    )


def local_gpus() -> int:
    """GPUs this machine shows a private Ray: none without an NVIDIA driver (known without
    importing torch), else torch's count (what `CUDA_VISIBLE_DEVICES` admits)."""
    if not (os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/nvidia0")):
        return 0
    import torch

    return int(torch.cuda.device_count())


def local_cpus(e: EngineConfig) -> float:
    """The CPUs of a private Ray of this run: `engine.ray_num_cpus`, else the machine's."""
    return float(e.ray_num_cpus or os.cpu_count() or 1)


def check_local(e: EngineConfig) -> None:
    """`rayfl run` before it starts a private Ray: the server and workers fit this machine (no
    GPU asked of a machine without one), else a UserError."""
    if e.executor != "ray" or e.address:
        return
    w, s = e.worker_resources, e.server_resources
    gpus = float(local_gpus()) if any(r.num_gpus > 0 for _, r in shapes(e)) else 0.0
    by_arch = max((r.num_gpus for r in e.resources_by_arch.values()), default=0.0)
    if gpus == 0 and (w.num_gpus > 0 or s.num_gpus > 0 or by_arch > 0):
        raise UserError(
            f"engine.worker_resources / resources_by_arch / server_resources ask for "
            f"{w.num_gpus:g} / {by_arch:g} / {s.num_gpus:g} GPU but this machine has no GPU; "
            f"{GPU_CLUSTER}"
        )
    check_shapes(e, {"CPU": local_cpus(e), "GPU": gpus}, where="this machine")


def local_note(e: EngineConfig) -> str:
    """`rayfl validate`'s warning (empty when it fits) for a local run this machine cannot
    place: the same config may be meant for a cluster; `rayfl run` refuses it."""
    try:
        check_local(e)
    except UserError as exc:
        return f"a local run would be refused: {exc}"
    return ""


def check_cluster(e: EngineConfig, cluster: ClusterSize) -> None:
    """`rayfl validate --cluster FILE`: the server and one worker each fit some node type (an
    actor never spans nodes), and with the pinned `engine.num_workers` fit the cluster at its
    maximum size; else a UserError naming the request, the nodes and the fix."""
    if e.executor != "ray":
        return
    nodes = f"{cluster.path} ({cluster.describe()})"
    for key, res in shapes(e):
        actor = "server" if key == "server_resources" else "worker"
        if res.num_cpus == 0 and res.num_gpus == 0:
            continue
        if not any(res.num_cpus <= n.cpus and res.num_gpus <= n.gpus for n in cluster.nodes):
            raise UserError(
                f"engine.{key} asks for {res.num_cpus:g} CPU / {res.num_gpus:g} GPU per {actor} "
                f"but no node type of {nodes} has that much, so it can never be placed; lower "
                f"engine.{key} or add a node type large enough to the cluster file"
            )
    check_shapes(e, cluster.total(), where=f"{nodes} at its maximum size")
