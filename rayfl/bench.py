"""`rayfl bench`: one fixed workload under several engine variants, side by side, in one invocation.

A benchmark file is an experiment config plus a `bench:` section:

    bench:
      warmup_rounds: 1          # rounds left out of the means (actor start, first-touch costs)
      variants:                 # label -> dotted overrides
        serial: [engine.executor=serial]
        ray: [engine.executor=ray]

For every variant it reports seconds per round, the pure training time measured inside the
workers (summed over clients), the orchestration overhead, the driver's peak resident memory, and
the ratio of each variant's seconds per round to the first variant's. Nothing here asserts speed:
it measures and prints.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from rayfl.config import build_config, read_yaml
from rayfl.engine.callbacks import Callback
from rayfl.errors import ConfigError


@dataclass(frozen=True)
class Bench:
    base: dict[str, Any]
    variants: dict[str, list[str]]
    warmup_rounds: int


def load_bench(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Bench:
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
    unknown = set(section) - {"variants", "warmup_rounds"}
    if unknown:
        raise ConfigError(
            f"unknown key bench.{sorted(unknown)[0]}; valid keys: variants, warmup_rounds"
        )
    variants = {str(k): [str(o) for o in (v or [])] for k, v in section["variants"].items()}
    for extra in variants.values():
        build_config(raw, [*overrides, *extra])  # every variant must be a valid run
    return Bench(
        raw,
        {k: [*overrides, *v] for k, v in variants.items()},
        int(section.get("warmup_rounds", 1)),
    )


class DriverMemory(Callback):
    """Samples the driver's resident memory after every round."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.peak = self.process.memory_info().rss

    def on_round_end(self, sim: Any, round_idx: int, metrics: dict[str, float]) -> None:
        self.peak = max(self.peak, self.process.memory_info().rss)


def run_bench(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> str:
    from rayfl.engine.loop import Simulation

    bench = load_bench(path, overrides)
    results: list[tuple[str, dict[str, float]]] = []
    for label, extra in bench.variants.items():
        cfg = build_config(
            bench.base, [*extra, "tracking.backend=none", "engine.checkpoint_every=0"]
        )
        gc.collect()
        mem = DriverMemory()
        start_rss = mem.peak
        sim = Simulation(cfg, "/tmp/rayfl-bench", [mem])
        build_s = time.perf_counter()
        result = sim.run()
        rows = result.history[bench.warmup_rounds :] or result.history
        n = len(rows)
        round_s = sum(r["time/round_s"] for r in rows) / n
        train_s = sum(r["time/train_s_sum"] for r in rows) / n
        fit_s = sum(r["time/fit_s"] for r in rows) / n
        server_s = sum(r["time/server_s"] for r in rows) / n
        workers = getattr(sim.executor, "num_workers", 1)
        results.append(
            (
                label,
                {
                    "round_s": round_s,
                    "train_s": train_s,
                    "workers": workers,
                    "server_s": server_s,
                    # client phase time not spent training, with the training spread over the workers
                    "overhead_s": max(0.0, fit_s - train_s / workers),
                    "acc": result.final.get("personal/acc", float("nan")),
                    "up_mb": sum(r.get("comm/bytes_up", 0.0) for r in rows) / n / 1e6,
                    "clients": cfg.data.num_clients,
                    "per_round": rows[-1]["clients"],
                    "peak_rss_mb": mem.peak / 2**20,
                    "rss_growth_mb": (mem.peak - start_rss) / 2**20,
                    "total_s": time.perf_counter() - build_s,
                },
            )
        )
    base_round = results[0][1]["round_s"]
    lines = [
        f"benchmark {Path(path).name}: {bench.warmup_rounds} warm-up round(s) left out of the means",
        f"  {'variant':10s} {'clients':>7s} {'/round':>6s} {'workers':>7s} {'s/round':>8s} {'train s':>8s} "
        f"{'overhead':>8s} {'server s':>8s} {'ratio':>6s} {'acc':>6s} {'up MB':>7s} {'driver peak MB':>14s} {'growth MB':>9s}",
    ]
    for label, r in results:
        lines.append(
            f"  {label:10s} {r['clients']:7d} {int(r['per_round']):6d} {r['workers']:7d} {r['round_s']:8.2f} "
            f"{r['train_s']:8.2f} {r['overhead_s']:8.2f} {r['server_s']:8.2f} {base_round / r['round_s']:6.2f} {r['acc']:6.3f} {r['up_mb']:7.3f} "
            f"{r['peak_rss_mb']:14.0f} {r['rss_growth_mb']:9.0f}"
        )
    lines.append(
        "  train s = training time measured inside the workers, summed over clients; overhead = client phase "
        "wall time - train s / workers (state moves, calls, client evaluation); server s = aggregation + "
        "server evaluation; ratio = first variant's s/round / this one's (above 1: faster); up MB = bytes "
        "uploaded per round"
    )
    return "\n".join(lines)
