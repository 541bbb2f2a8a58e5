"""The floors the benchmark (`bench.py`) compares variants with, and what measures them (memory,
reports).

The compute floor of a variant with W workers: W single-thread processes without Ray, started
together, that share the run's client trainings (every sampled client of every round, split
longest first so each process gets the same work) and do nothing else: no server step, no
evaluation. Its end-to-end time is from their start to the last one's exit, imports and data
loading included: what W perfectly busy workers on this machine need for the training alone,
with the same contention for the cores that the variant's W workers meet. Every variant's
end-to-end time is printed as a ratio to the floor of its worker count. Nothing here asserts
speed: it measures and prints.

With `bench.ray_floor: true`, the Ray floor of W workers is measured too: the floor's very work
(each share loads the data and trains its clients, nothing else) in W Ray actors of the variant's
worker resources, started by a driver that imports no torch, starts a private Ray with the options
a run uses (`rayfl.engine.startup.init_ray`), waits for the shares and stops Ray with
`ray.shutdown()`. Its end to end over the floor's is what stock Ray costs on this machine with its
supported start (its daemons, its start and its shutdown) before rayfl does anything: no round
barrier, no server, no evaluation, no state moves. A variant's ratio to it is what rayfl adds.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from rayfl import gate
from rayfl.config import build_config
from rayfl.engine.startup import init_ray_for_run, spill_dir
from rayfl.errors import UserError
from rayfl.schema import RunConfig, clients_per_round, to_dict

BENCH = Path(__file__).resolve().with_name("bench.py")  # the children run this script
FLOOR = "floor"
RAY_FLOOR = "rayfloor"
FLOOR_OVERRIDES = ["engine.executor=serial", "engine.num_threads=1", "engine.server_threads=1"]
RUN_OVERRIDES = ["tracking.backend=none", "engine.checkpoint_every=0"]
SHARE_KEYS = ("startup_s", "train_s", "trainings")  # a floor share's report (`train_share`)


def floor_label(workers: int) -> str:
    return f"{FLOOR}-{workers}w"


def ray_floor_label(workers: int) -> str:
    return f"{RAY_FLOOR}-{workers}w"


@dataclass
class TreeMemory:
    """Peak memory of a process and of everything it started (sampled in a thread)."""

    pid: int
    # 1 s: each sample reads every process's smaps (~2.3 ms for a torch process), CPU the
    # measured run loses; a Ray run has ~7 processes against a floor's 2
    interval_s: float = 1.0
    driver_peak: int = 0
    others_peak: int = 0  # summed PSS of the descendants (Ray's daemons and workers)
    total_peak: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    def sample(self) -> None:
        try:
            root = psutil.Process(self.pid)
            driver = root.memory_info().rss
            others = 0
            for child in root.children(recursive=True):
                try:
                    others += child.memory_full_info().pss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
        except psutil.NoSuchProcess:
            return
        self.driver_peak = max(self.driver_peak, driver)
        self.others_peak = max(self.others_peak, others)
        self.total_peak = max(self.total_peak, driver + others)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> TreeMemory:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def folder_bytes(folder: Path) -> float:
    """Bytes of the regular files under `folder` (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return float(total)


def write_config(cfg: RunConfig, out: gate.Folder) -> Path:
    """`bench_config.yaml` in `out`, the config a child process loads (written through the gate:
    a symlink planted there is replaced, not written through)."""
    return out.write("bench_config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False).encode())


def read_report(out: gate.Folder, name: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """A child's report (`share<k>.json`, `bench.json`, `rayfloor.json`) read back from the
    benchmark folder `out` through rayfl.gate: a symlink, FIFO, oversized or deeply nested file,
    one this user's rayfl did not write, or one without `keys`, is refused in one line (the
    folder may be shared, docs/security.md).

    Raises:
        UserError: the file is unsafe or not a report a child wrote.
    """
    path = out.path / name
    try:
        report = json.loads(out.read(name, gate.JSON_LIMIT))
    except FileNotFoundError:
        raise UserError(
            f"{path}: the benchmark's child exited without writing its report; run the "
            "variant's config with `rayfl run` to see why"
        ) from None
    except (ValueError, RecursionError):
        raise gate.refuse(path, "is not valid JSON") from None
    if not isinstance(report, dict) or not all(k in report for k in keys):
        raise UserError(
            f"{path}: not a report the benchmark's child wrote (it needs {', '.join(keys)}); "
            "remove the benchmark folder and run again"
        )
    return report


def run_floor(
    raw: dict[str, Any], overrides: tuple[str, ...], workers: int, out: gate.Folder
) -> dict[str, Any]:
    """The compute floor of `workers` workers: that many single-thread processes, started
    together, each training its share of the run's clients (`floor_shares`); end to end is from
    their start to the last exit."""
    cfg = build_config(raw, [*overrides, *FLOOR_OVERRIDES, *RUN_OVERRIDES])
    config_path = write_config(cfg, out)
    reports = [f"share{k}.json" for k in range(workers)]
    start = time.perf_counter()
    children = [
        subprocess.Popen(
            [sys.executable, str(BENCH), "--floor", str(config_path), str(out.path / name)]
            + [str(k), str(workers)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for k, name in enumerate(reports)
    ]
    with TreeMemory(os.getpid()) as mem:  # the floor's processes are this one's children
        outputs = [child.communicate()[0] for child in children]
    wall_s = time.perf_counter() - start
    for child, output in zip(children, outputs):
        check_child(child.returncode, output, "floor")
    shares = [read_report(out, name, SHARE_KEYS) for name in reports]
    return _floor_report(
        cfg, workers, wall_s, shares, memory_bytes=(math.nan, math.nan, mem.others_peak)
    )


def run_ray_floor(
    raw: dict[str, Any], overrides: tuple[str, ...], workers: int, out: gate.Folder
) -> dict[str, Any]:
    """The Ray floor of `workers` workers (the module's docstring): the floor's shares in Ray
    actors, in one driver process, end to end from its start to its exit."""
    cfg = build_config(raw, [*overrides, *FLOOR_OVERRIDES, *RUN_OVERRIDES])
    config_path = write_config(cfg, out)
    args = ["--ray-floor", str(config_path), str(out.path), str(workers)]
    wall_s, mem = run_child(args, "Ray floor")
    shares = read_report(out, "rayfloor.json", ("shares",))["shares"]
    if not isinstance(shares, list) or len(shares) != workers:
        raise UserError(f"{out.path / 'rayfloor.json'}: not a report the Ray floor wrote")
    for share in shares:
        if not isinstance(share, dict) or not all(k in share for k in SHARE_KEYS):
            raise UserError(f"{out.path / 'rayfloor.json'}: not a report the Ray floor wrote")
    peaks = (mem.driver_peak, mem.others_peak, mem.total_peak)
    # nothing to spill: the shares put no objects (their reports are a few bytes), and the
    # spill folder, read after Ray's shutdown, could not show what it held anyway
    return _floor_report(cfg, workers, wall_s, shares, memory_bytes=peaks)


def run_child(args: list[str], what: str) -> tuple[float, TreeMemory]:
    """`bench.py *args` (a variant or the Ray floor) to its exit, the memory of its
    process tree sampled meanwhile; returns its wall time and that memory.

    Raises:
        UserError: it failed (with the last lines of its output).
    """
    start = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, str(BENCH), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    with TreeMemory(child.pid) as mem:
        output, _ = child.communicate()
    wall_s = time.perf_counter() - start
    check_child(child.returncode, output, what)
    return wall_s, mem


def check_child(returncode: int, output: str, what: str) -> None:
    if returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise UserError(f"benchmark {what} failed (exit {returncode}):\n{tail}")


def _floor_report(
    cfg: RunConfig,
    workers: int,
    wall_s: float,
    shares: list[dict[str, Any]],
    memory_bytes: tuple[float, float, float],
) -> dict[str, Any]:
    """A floor's row from its shares' reports; `memory_bytes`: the peaks of the driver, of the
    processes it started and of both (nan: none)."""
    driver, others, total = memory_bytes
    return {
        "rounds": [],
        "floor": True,
        "wall_s": wall_s,
        "workers": workers,
        "clients": cfg.data.num_clients,
        "per_round": clients_per_round(cfg),
        "startup_s": max(x["startup_s"] for x in shares),
        "in_run_s": max(x["train_s"] for x in shares),
        "train_s": sum(x["train_s"] for x in shares),
        "trainings": sum(x["trainings"] for x in shares),
        "driver_peak_mb": driver / 2**20,
        "ray_peak_mb": others / 2**20,
        "total_peak_mb": total / 2**20,
        "store_peak_mb": 0.0,
        "spilled_mb": 0.0,
    }


def floor_shares(
    cfg: RunConfig, train_sizes: list[int], workers: int
) -> list[list[tuple[int, int]]]:
    """The run's client trainings, (round, client) for every sampled client of every round,
    split over `workers` so that each gets the same number of samples to train (largest first,
    each to the least loaded)."""
    from rayfl.sampling import sample_clients

    per_round = clients_per_round(cfg)
    jobs = [
        (rnd, c)
        for rnd in range(1, cfg.engine.rounds + 1)
        for c in sample_clients(cfg.seed, rnd, cfg.data.num_clients, per_round, cfg.engine.sampling)
    ]
    jobs.sort(key=lambda j: (-train_sizes[j[1]], j))
    shares: list[list[tuple[int, int]]] = [[] for _ in range(workers)]
    load = [0] * workers
    for job in jobs:
        k = min(range(workers), key=lambda i: (load[i], i))
        shares[k].append(job)
        load[k] += train_sizes[job[1]]
    return [sorted(share) for share in shares]


def train_share(config_path: str, share: int, workers: int, origin: float) -> dict[str, float]:
    """One share of the floor: load the data as a run does, then train the share's clients
    with the serial executor, the same code a worker runs; nothing else. `startup_s` is from
    `origin` (wall clock: the start of the process that the floor's time counts from) to the
    share's first training."""
    from rayfl.config import load_config
    from rayfl.engine.executor import SerialExecutor
    from rayfl.engine.loop import Simulation

    cfg = load_config(config_path)
    sim = Simulation(cfg, Path(config_path).parent)
    executor = SerialExecutor(sim.spec, sim.federation)
    jobs = floor_shares(cfg, [len(c.train) for c in sim.federation.clients], workers)[share]
    startup_s = time.time() - origin
    train_s = 0.0
    for rnd in sorted({r for r, _ in jobs}):
        clients = [c for r, c in jobs if r == rnd]
        _, payloads = executor.broadcast(rnd, sorted({sim.archs[c] for c in clients}))
        start = time.perf_counter()
        executor.fit(rnd, clients, payloads, False)
        train_s += time.perf_counter() - start
    return {"startup_s": startup_s, "train_s": train_s, "trainings": len(jobs)}


def floor_main(config_path: str, report_path: str, share: int, workers: int) -> None:
    """One process of the floor: its share (`train_share`), timed from this process's start."""
    report = train_share(config_path, share, workers, psutil.Process().create_time())
    gate.write(report_path, json.dumps(report).encode())


class FloorShare:
    """The Ray floor's actor: one share of the floor's work (`train_share`)."""

    def train(self, config_path: str, share: int, workers: int, origin: float) -> dict[str, float]:
        return train_share(config_path, share, workers, origin)


def ray_floor_main(config_path: str, out: str, workers: int) -> None:
    """The Ray floor's driver: a private Ray started with a run's options, `workers` actors of
    the run's worker resources, one share each, then `ray.shutdown()`. It imports no torch."""
    import ray

    from rayfl.config import load_config

    origin = psutil.Process().create_time()
    cfg = load_config(config_path)
    e = cfg.engine
    init_ray_for_run(e, spill_dir(out))
    # Ray's workers do not have this script's folder on their path (rayfl starts Ray with an
    # empty working_dir), so the actor's class travels by value, not as `bench_floors.FloorShare`
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        res = e.worker_resources
        actor: Any = ray.remote(FloorShare).options(num_cpus=res.num_cpus, num_gpus=res.num_gpus)
        calls = [
            actor.remote().train.remote(config_path, k, workers, origin) for k in range(workers)
        ]
        shares = ray.get(calls)
    finally:
        ray.shutdown()
    with gate.Folder(out) as folder:
        folder.write("rayfloor.json", json.dumps({"shares": shares}).encode())
