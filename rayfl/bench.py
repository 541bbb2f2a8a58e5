"""`rayfl bench`: one fixed workload under several engine variants, end to end, side by side.

A benchmark file is an experiment config plus a `bench:` section:

    bench:
      warmup_rounds: 1          # rounds left out of the steady s/round (first-touch costs)
      floor: true               # also measure the compute floor (below)
      variants:                 # label -> dotted overrides
        ray: [engine.executor=ray]
        grouped: [engine.executor=ray, engine.grouped=true]

Every variant runs as its own process (`python -m rayfl.bench --variant ...`), exactly as a user's
`rayfl run` would: its end-to-end time starts at the command and includes imports, Ray's start,
data loading, actors, every round and the shutdown. While it runs, the driver's resident memory
and the proportional memory (PSS) of every process it started (Ray's daemons and workers) are
sampled; inside the run, a callback samples the object store's use.

The compute floor: the same clients trained one after another in one single-thread process
without Ray (the serial executor, `num_threads=1`); the floor of a variant with W workers is
the floor run's summed client training time divided by W: what W perfectly busy workers would
need. Every variant's end-to-end time is printed as a ratio to its floor. Nothing here asserts
speed: it measures and prints.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from rayfl.config import RunConfig, build_config, clients_per_round, read_yaml, to_dict
from rayfl.engine.callbacks import Callback
from rayfl.errors import ConfigError, UserError

FLOOR = "floor"
FLOOR_OVERRIDES = ["engine.executor=serial", "engine.num_threads=1", "engine.server_threads=1"]


@dataclass(frozen=True)
class Bench:
    base: dict[str, Any]
    variants: dict[str, list[str]]
    warmup_rounds: int
    floor: bool = True


def load_bench(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Bench:
    """The benchmark file; command-line `overrides` apply to every variant, after its own."""
    raw = read_yaml(path, "benchmark file")
    section = raw.pop("bench", None)
    if (
        not isinstance(section, dict)
        or not isinstance(section.get("variants"), dict)
        or not section["variants"]
    ):
        raise ConfigError(
            f"{path}: a benchmark needs bench.variants (label -> list of key=value overrides)"
        )
    unknown = set(section) - {"variants", "warmup_rounds", "floor"}
    if unknown:
        raise ConfigError(
            f"unknown key bench.{sorted(unknown)[0]}; valid keys: variants, warmup_rounds, floor"
        )
    variants = {str(k): [*map(str, v or []), *overrides] for k, v in section["variants"].items()}
    if FLOOR in variants:
        raise ConfigError(f"bench.variants: {FLOOR!r} is reserved for the compute floor")
    floor = bool(section.get("floor", True))
    if floor:
        variants[FLOOR] = [*overrides, *FLOOR_OVERRIDES]
    for extra in variants.values():
        build_config(raw, extra)  # every variant must be a valid run
    return Bench(raw, variants, int(section.get("warmup_rounds", 1)), floor)


def planned_workers(cfg: RunConfig) -> int:
    """The workers a Ray run of `cfg` starts on this machine (`plan_workers`, without Ray)."""
    e = cfg.engine
    if e.executor == "serial":
        return 1
    if e.num_workers:
        return e.num_workers
    cpus = e.ray_num_cpus or os.cpu_count() or 1
    fit = math.floor((cpus - e.server_resources.num_cpus) / max(e.worker_resources.num_cpus, 1e-9))
    return max(1, min(math.ceil(clients_per_round(cfg) / e.clients_per_call), fit))


# ----------------------------------------------------------------------------- measuring


@dataclass
class TreeMemory:
    """Peak memory of a process and of everything it started (sampled in a thread)."""

    pid: int
    interval_s: float = 0.5
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


class StoreProbe(Callback):
    """Callback (inside a variant's run): peak object-store use, sampled after every round."""

    def __init__(self) -> None:
        self.peak_bytes = 0.0
        self.spilled_bytes = 0.0

    def on_round_end(self, sim: Any, round_idx: int, metrics: dict[str, float]) -> None:
        used, spilled = object_store_use()
        self.peak_bytes = max(self.peak_bytes, used)
        self.spilled_bytes = max(self.spilled_bytes, spilled)


def object_store_use() -> tuple[float, float]:
    """(bytes in the object store now, bytes spilled so far) over the nodes; 0 without Ray."""
    try:
        import ray
        from ray._private.internal_api import get_memory_info_reply, get_state_from_address

        if not ray.is_initialized():
            return 0.0, 0.0
        reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
        stats = reply.store_stats
        return float(stats.object_store_bytes_used), float(stats.spilled_bytes_total)
    except Exception:  # private API: a measurement, never a failure
        return float("nan"), float("nan")


def run_variant(raw: dict[str, Any], overrides: list[str], out: Path) -> dict[str, Any]:
    """Run one variant in its own process; its wall time, memory and the run's own numbers."""
    cfg = build_config(raw, [*overrides, "tracking.backend=none", "engine.checkpoint_every=0"])
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "bench_config.yaml"
    config_path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    run_dir = out / "run"
    start = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-m", "rayfl.bench", "--variant", str(config_path), str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    with TreeMemory(child.pid) as mem:
        output, _ = child.communicate()
    wall_s = time.perf_counter() - start
    if child.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-15:])
        raise UserError(f"benchmark variant failed (exit {child.returncode}):\n{tail}")
    report = json.loads((run_dir / "bench.json").read_text())
    report.update(
        wall_s=wall_s,
        workers=planned_workers(cfg),
        clients=cfg.data.num_clients,
        driver_peak_mb=mem.driver_peak / 2**20,
        ray_peak_mb=mem.others_peak / 2**20,
        total_peak_mb=mem.total_peak / 2**20,
    )
    return report


def _variant_main(config_path: str, run_dir: str) -> None:
    """The child: `rayfl run` of the config, plus the object-store probe; writes bench.json."""
    from rayfl.config import load_config
    from rayfl.launch import simulate

    cfg = load_config(config_path)
    probe = StoreProbe()
    result = simulate(cfg, run_dir, progress=False, extra_callbacks=[probe])
    history = result.history
    report = {
        "rounds": [{k: v for k, v in r.items() if isinstance(v, int | float)} for r in history],
        "store_peak_mb": probe.peak_bytes / 2**20,
        "spilled_mb": probe.spilled_bytes / 2**20,
        "status": result.status,
    }
    (Path(run_dir) / "bench.json").write_text(json.dumps(report, default=float))


# ----------------------------------------------------------------------------- the report


def _mean(rows: list[dict[str, float]], key: str) -> float:
    return sum(x.get(key, 0.0) for x in rows) / max(1, len(rows))


def summarize(r: dict[str, Any], warmup: int) -> dict[str, Any]:
    rows = r["rounds"]
    steady = rows[warmup:] or rows
    first = rows[0] if rows else {}
    return {
        **r,
        "startup_s": first.get("time/startup/first_round_at_s", float("nan")),
        "in_run_s": sum(x.get("time/round_s", 0.0) for x in rows),
        "round_s": sum(x.get("time/round_s", 0.0) for x in steady) / max(1, len(steady)),
        "train_s": sum(x.get("time/train_s_sum", 0.0) for x in rows),
        "server_s": _mean(steady, "time/server_s"),
        # client phase time not spent training, with the training spread over the workers
        "overhead_s": max(
            0.0, _mean(steady, "time/fit_s") - _mean(steady, "time/train_s_sum") / r["workers"]
        ),
        "up_mb": _mean(steady, "comm/bytes_up") / 1e6,
        "per_round": rows[-1].get("clients", float("nan")) if rows else float("nan"),
        "acc": next(
            (x["personal/acc"] for x in reversed(rows) if "personal/acc" in x), float("nan")
        ),
    }


def format_report(name: str, bench: Bench, results: dict[str, dict[str, Any]]) -> str:
    floor = results.get(FLOOR)
    lines = [
        f"benchmark {name}: end to end = the variant's process from command to exit; "
        f"{bench.warmup_rounds} warm-up round(s) left out of s/round",
        f"  {'variant':12s} {'clients':>7s} {'/round':>6s} {'workers':>7s} {'e2e s':>8s} "
        f"{'startup':>7s} {'in-run s':>8s} {'s/round':>8s} {'clients/s':>9s} {'train s':>8s} "
        f"{'overhead':>8s} {'server s':>8s} {'up MB':>7s} {'acc':>6s} "
        f"{'driver MB':>9s} {'ray MB':>8s} {'total MB':>8s} {'store MB':>8s} {'floor s':>8s} {'x floor':>7s}",
    ]
    for label, r in results.items():
        floor_s = floor["train_s"] / r["workers"] if floor else float("nan")
        ratio = r["wall_s"] / floor_s if floor and floor_s > 0 else float("nan")
        lines.append(
            f"  {label:12s} {r['clients']:7d} {r['per_round']:6.0f} {r['workers']:7d} "
            f"{r['wall_s']:8.1f} {r['startup_s']:7.1f} {r['in_run_s']:8.1f} {r['round_s']:8.2f} "
            f"{r['per_round'] / r['round_s'] if r['round_s'] else float('nan'):9.1f} "
            f"{r['train_s']:8.1f} {r['overhead_s']:8.2f} {r['server_s']:8.2f} {r['up_mb']:7.3f} "
            f"{r['acc']:6.3f} {r['driver_peak_mb']:9.0f} {r['ray_peak_mb']:8.0f} "
            f"{r['total_peak_mb']:8.0f} {r['store_peak_mb']:8.1f} {floor_s:8.1f} {ratio:7.2f}"
        )
    lines.append(
        "  e2e = wall time of the variant's process (imports, Ray start, data, actors, rounds, exit); "
        "startup = process start to first round; clients/s = clients per round / steady s/round; train s = client training measured inside the "
        "workers, summed over the run; overhead = client phase per round - its training / workers "
        "(state moves, calls, client evaluation); server s = server step per round; up MB = "
        "uploads per round; floor s = the floor run's train s / this variant's workers (one "
        "single-thread process, no Ray); x floor = e2e / floor s; ray MB = summed PSS of the "
        "processes the run started (Ray daemons, workers), peak; total = driver + ray; store = "
        "object store in use, peak"
    )
    return "\n".join(lines)


def run_bench(
    path: str | Path, overrides: list[str] | tuple[str, ...] = (), out: str | Path | None = None
) -> str:
    bench = load_bench(path, overrides)
    root = Path(out) if out else Path(tempfile.mkdtemp(prefix="rayfl-bench-"))
    results: dict[str, dict[str, Any]] = {}
    order = ([FLOOR] if bench.floor else []) + [k for k in bench.variants if k != FLOOR]
    for label in order:
        report = run_variant(bench.base, bench.variants[label], root / label)
        results[label] = summarize(report, bench.warmup_rounds)
        print(f"  ... {label}: {report['wall_s']:.1f} s end to end", file=sys.stderr, flush=True)
    text = format_report(Path(path).name, bench, results)
    (root / "report.txt").write_text(text + "\n")
    return text + f"\n  runs and report: {root}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rayfl.bench")
    parser.add_argument("--variant", nargs=2, metavar=("CONFIG", "RUN_DIR"), required=True)
    args = parser.parse_args(argv)
    _variant_main(*args.variant)
    return 0


if __name__ == "__main__":
    sys.exit(main())
