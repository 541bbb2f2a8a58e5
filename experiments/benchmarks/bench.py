"""rayfl's speed benchmark: one fixed workload under several engine variants, end to end, side
by side. Not part of the installed package; run it from a checkout:

    python3 experiments/benchmarks/bench.py experiments/benchmarks/throughput.yaml
    python3 experiments/benchmarks/bench.py experiments/benchmarks/fedavg_cnn_small.yaml \
        engine.rounds=2 --only ray --out bench-fedavg --repeat 3

A benchmark file is an experiment config plus a `bench:` section:

    bench:
      warmup_rounds: 1          # rounds left out of the steady s/round (first-touch costs)
      floor: true               # also measure the compute floor (below)
      variants:                 # label -> dotted overrides
        ray: [engine.executor=ray]
        small_calls: [engine.executor=ray, engine.clients_per_call=1]

Every variant runs as its own process (this script with `--variant ...`), exactly as a user's
`rayfl run` would: its end-to-end time starts at the command and includes imports, Ray's start,
data loading, actors, every round and the shutdown. While it runs, the driver's resident memory
and the proportional memory (PSS) of every process it started (Ray's daemons and workers) are
sampled; inside the run, a callback samples the shared memory in use (Ray's object store lives
there) and the bytes spilled to disk (the run's spill folder).

The compute floor and the Ray floor a variant is compared with: `bench_floors.py`. Nothing
here asserts speed: it measures and prints.

The benchmark's folder (`--out`, default a new temporary one) is held through rayfl.gate like a
run's: its `[rep<k>/]<label>[/run]` folders are made without following a link before anything
runs, and a child's report is read back only if this user's rayfl wrote it (docs/security.md).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from bench_floors import (  # this script's folder is on sys.path
    FLOOR,
    RAY_FLOOR,
    RUN_OVERRIDES,
    floor_label,
    floor_main,
    folder_bytes,
    ray_floor_label,
    ray_floor_main,
    read_report,
    run_child,
    run_floor,
    run_ray_floor,
    write_config,
)

from rayfl import gate
from rayfl.config import build_config, load_config, read_yaml
from rayfl.engine.hooks import Callback
from rayfl.engine.startup import spill_dir
from rayfl.errors import ConfigError, UserError
from rayfl.resources import local_cpus, worker_capacity
from rayfl.schema import RunConfig, clients_per_round

RUN = "run"  # a variant's run folder, inside the variant's own


@dataclass(frozen=True)
class Bench:
    base: dict[str, Any]
    variants: dict[str, list[str]]
    warmup_rounds: int
    floor: bool = True
    overrides: tuple[str, ...] = ()
    ray_floor: bool = False

    def floors(self) -> list[int]:
        """The worker counts whose compute floor the variants are compared with."""
        if not self.floor:
            return []
        return sorted({planned_workers(build_config(self.base, v)) for v in self.variants.values()})


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
    keys = ("variants", "warmup_rounds", "floor", "ray_floor")
    unknown = set(section) - set(keys)
    if unknown:
        raise ConfigError(f"unknown key bench.{sorted(unknown)[0]}; valid keys: {', '.join(keys)}")
    variants = {str(k): [*map(str, v or []), *overrides] for k, v in section["variants"].items()}
    for reserved in (FLOOR, RAY_FLOOR):
        if any(k == reserved or k.startswith(f"{reserved}-") for k in variants):
            raise ConfigError(f"bench.variants: {reserved!r} is reserved for the floors")
    for extra in variants.values():
        build_config(raw, extra)  # every variant must be a valid run
    floor = bool(section.get("floor", True))
    ray_floor = bool(section.get("ray_floor", False))
    if ray_floor and not floor:
        raise ConfigError("bench.ray_floor needs bench.floor: the Ray floor is compared with it")
    warmup = int(section.get("warmup_rounds", 1))
    return Bench(raw, variants, warmup, floor, tuple(overrides), ray_floor)


def only(bench: Bench, labels: list[str]) -> Bench:
    """The benchmark restricted to the variants `labels` (their floors stay)."""
    unknown = [x for x in labels if x not in bench.variants]
    if unknown:
        raise ConfigError(
            f"--only {unknown[0]!r}: no such variant; this benchmark has {', '.join(bench.variants)}"
        )
    return replace(bench, variants={k: v for k, v in bench.variants.items() if k in labels})


def planned_workers(cfg: RunConfig) -> int:
    """The workers a Ray run of `cfg` starts on this machine (`plan_workers`, without Ray)."""
    e = cfg.engine
    if e.executor == "serial":
        return 1
    if e.num_workers:
        return e.num_workers
    # CPUs only: the benchmark's floors and variants are sized for this machine's CPUs
    fit = worker_capacity(e, {"CPU": local_cpus(e), "GPU": math.inf})
    return max(1, min(math.ceil(clients_per_round(cfg) / e.clients_per_call), fit))


# ----------------------------------------------------------------------------- measuring


class StoreProbe(Callback):
    """Callback (inside a variant's run), sampled after every round: the peak growth of shared
    memory in use since the run started (`/dev/shm`, where Ray's object store maps its objects;
    other processes' use there shows too) and the peak bytes in `spill_dir` (what Ray spilled
    to disk). Both from the operating system, not from Ray's internals."""

    def __init__(self, spill_dir: str | Path) -> None:
        self.spill_dir = Path(spill_dir)
        self._shm_before = shared_memory_used()
        self.peak_bytes = 0.0
        self.spilled_bytes = 0.0

    def on_round_end(self, sim: Any, round_idx: int, metrics: dict[str, float]) -> None:
        self.peak_bytes = max(self.peak_bytes, shared_memory_used() - self._shm_before)
        self.spilled_bytes = max(self.spilled_bytes, folder_bytes(self.spill_dir))


def shared_memory_used(path: str = "/dev/shm") -> float:
    """Bytes in use on the shared-memory file system (nan where there is none)."""
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return float("nan")
    return float(usage.used)


def run_variant(raw: dict[str, Any], overrides: list[str], out: gate.Folder) -> dict[str, Any]:
    """Run one variant in its own process into `out/run`; its wall time, memory and the run's
    own numbers."""
    cfg = build_config(raw, [*overrides, *RUN_OVERRIDES])
    config_path = write_config(cfg, out)
    with out.sub(RUN, create=True) as run:  # a link planted there is refused, not followed
        wall_s, mem = run_child(["--variant", str(config_path), str(run.path)], "variant")
        report = read_report(run, "bench.json", ("rounds", "store_peak_mb", "spilled_mb"))
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
    from rayfl.launch import simulate

    # as `rayfl run CONFIG --out run_dir` does: a private Ray spills under run_dir
    cfg = load_config(config_path)
    probe = StoreProbe(cfg.engine.spill_dir or spill_dir(run_dir))
    result = simulate(cfg, run_dir, progress=False, extra_callbacks=[probe], existing="replace")
    history = result.history
    report = {
        "rounds": [{k: v for k, v in r.items() if isinstance(v, int | float)} for r in history],
        "store_peak_mb": probe.peak_bytes / 2**20,
        "spilled_mb": probe.spilled_bytes / 2**20,
        "status": result.status,
    }
    with gate.Folder(run_dir) as folder:
        folder.write("bench.json", json.dumps(report, default=float).encode())


# ----------------------------------------------------------------------------- the report


def _mean(rows: list[dict[str, float]], key: str) -> float:
    return sum(x.get(key, 0.0) for x in rows) / max(1, len(rows))


def summarize(r: dict[str, Any], warmup: int) -> dict[str, Any]:
    if r.get("floor"):
        return {
            **r,
            # every share trains its part of every round side by side: a round of the floor
            # takes the longest share's time over the rounds
            "round_s": r["in_run_s"] / max(1, r["trainings"] / r["per_round"]),
            "overhead_s": 0.0,
            "server_s": 0.0,
            "up_mb": 0.0,
            "acc": float("nan"),
            "plain_round_s": float("nan"),
            "eval_s": 0.0,
        }
    rows = r["rounds"]
    steady = rows[warmup:] or rows
    first = rows[0] if rows else {}
    # rounds without the clients' evaluation (which scores every registered client under the
    # `deployed` protocol): what the round costs as the federation grows
    plain = [x for x in steady if "eval/clients" not in x]
    evaluated = [x for x in rows if "eval/clients" in x]
    return {
        **r,
        "startup_s": first.get("time/startup/first_round_at_s", float("nan")),
        "in_run_s": sum(x.get("time/round_s", 0.0) for x in rows),
        "round_s": sum(x.get("time/round_s", 0.0) for x in steady) / max(1, len(steady)),
        "plain_round_s": _mean(plain, "time/round_s") if plain else float("nan"),
        "eval_s": _mean(evaluated, "time/eval_s"),
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
    lines = [
        f"benchmark {name}: end to end = the variant's process from command to exit; "
        f"{bench.warmup_rounds} warm-up round(s) left out of s/round",
        f"  {'variant':14s} {'clients':>7s} {'/round':>6s} {'workers':>7s} {'e2e s':>8s} "
        f"{'startup':>7s} {'in-run s':>8s} {'s/round':>8s} {'no-eval':>7s} {'eval s':>6s} "
        f"{'clients/s':>9s} {'train s':>8s} "
        f"{'overhead':>8s} {'server s':>8s} {'up MB':>7s} {'acc':>6s} "
        f"{'driver MB':>9s} {'ray MB':>8s} {'total MB':>8s} {'store MB':>8s} {'spill MB':>8s} {'floor s':>8s} {'x floor':>7s}",
    ]
    repeated: list[str] = []
    for label, r in results.items():
        floor = results.get(floor_label(r["workers"]))
        floor_s = floor["wall_s"] if floor else float("nan")
        ratio = r["wall_s"] / floor_s if floor and floor_s > 0 else float("nan")
        if len(r.get("ratios", ())) > 1:  # repeated: the median of the paired ratios
            ratio = statistics.median(r["ratios"])
            each = " ".join(f"{x:.2f}" for x in r["ratios"])
            repeated.append(f"  {label}: x floor per repetition {each} (median {ratio:.2f})")
        lines.append(
            f"  {label:14s} {r['clients']:7d} {r['per_round']:6.0f} {r['workers']:7d} "
            f"{r['wall_s']:8.1f} {r['startup_s']:7.1f} {r['in_run_s']:8.1f} {r['round_s']:8.2f} "
            f"{r['plain_round_s']:7.2f} {r['eval_s']:6.2f} "
            f"{r['per_round'] / r['round_s'] if r['round_s'] else float('nan'):9.1f} "
            f"{r['train_s']:8.1f} {r['overhead_s']:8.2f} {r['server_s']:8.2f} {r['up_mb']:7.3f} "
            f"{r['acc']:6.3f} {r['driver_peak_mb']:9.0f} {r['ray_peak_mb']:8.0f} "
            f"{r['total_peak_mb']:8.0f} {r['store_peak_mb']:8.1f} {r.get('spilled_mb', 0.0):8.1f} {floor_s:8.1f} {ratio:7.2f}"
        )
    if repeated:
        lines.append(
            f"  {len(results[next(iter(results))]['ratios'])} repetitions, floor and variants "
            "alternating: each row is the median repetition's; x floor = median of the paired ratios"
        )
        lines += repeated
    for label, r in results.items():  # what rayfl adds to stock Ray's own cost
        ray_ratios = r.get("ray_ratios") or []
        if ray_ratios:
            each = " ".join(f"{x:.2f}" for x in ray_ratios)
            lines.append(
                f"  {label}: x {ray_floor_label(r['workers'])} per repetition {each} "
                f"(median {statistics.median(ray_ratios):.2f})"
            )
    lines.append(
        "  e2e = wall time of the variant's process (imports, Ray start, data, actors, rounds, exit); "
        "startup = process start to first round; no-eval = s/round of the steady rounds without "
        "the clients' evaluation; eval s = the clients' evaluation per evaluating round; "
        "clients/s = clients per round / steady s/round; "
        "train s = client training measured inside the workers, summed over the run; overhead = "
        "client phase per round - its training / workers (state moves, calls, client evaluation); "
        "server s = server step per round; up MB = uploads per round; "
        f"{floor_label(0).replace('0', 'W')} = the compute floor of W workers: W single-thread "
        "processes without Ray, started together, sharing the run's client trainings and nothing "
        "else (e2e: their start to the last exit; in-run: the longest share's training); "
        f"{ray_floor_label(0).replace('0', 'W')} = the same shares in W Ray actors of the "
        "variant's worker resources, from a driver that starts and stops a private Ray as a run "
        "does (what stock Ray costs before rayfl does anything); floor s "
        "= the e2e of the floor with this variant's workers; x floor = e2e / floor s; ray MB = "
        "summed PSS of the processes the run started (Ray daemons, workers), peak; total = driver "
        "+ ray (a floor: its processes); store = shared memory (/dev/shm, Ray's object store) in "
        "use, peak growth over the run; spill MB = bytes Ray spilled to disk (the run's "
        "ray-spill folder or engine.spill_dir), peak: on disk, not in total MB"
    )
    return "\n".join(lines)


def run_bench(
    path: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    out: str | Path | None = None,
    variants: list[str] | None = None,
    repeat: int = 1,
) -> str:
    """Run the floors and the variants, one after another, `repeat` times over (the floor and
    the variants alternate, so that a machine whose speed drifts, like a shared VM, moves both
    alike), and report each variant at its median repetition."""
    if repeat < 1:
        raise UserError(f"--repeat {repeat}: give 1 or more repetitions")
    bench = load_bench(path, overrides)
    if variants:
        bench = only(bench, variants)
    runs = _runs(bench)
    with gate.Folder(out or tempfile.mkdtemp(prefix="rayfl-bench-"), create=True) as root:
        folders = _folders(root, [label for label, _ in runs], bench.variants, repeat)
        try:
            reps: list[dict[str, dict[str, Any]]] = []
            for k in range(1, repeat + 1):
                tag = "" if repeat == 1 else f" (repetition {k} of {repeat})"
                results: dict[str, dict[str, Any]] = {}
                for label, run in runs:
                    report = run(folders[k, label])
                    results[label] = summarize(report, bench.warmup_rounds)
                    print(
                        f"  ... {label}: {report['wall_s']:.1f} s end to end{tag}",
                        file=sys.stderr,
                        flush=True,
                    )
                reps.append(results)
        finally:
            for folder in folders.values():
                folder.close()
        text = format_report(Path(path).name, bench, median_repetition(reps))
        root.write("report.txt", (text + "\n").encode())
    return text + f"\n  runs and report: {root.path}"


def _folders(
    root: gate.Folder, labels: list[str], variants: dict[str, list[str]], repeat: int
) -> dict[tuple[int, str], gate.Folder]:
    """Every folder the benchmark writes into, `[rep<k>/]<label>` (and a variant's `run`),
    made through the gate before anything runs: a symlink planted on the way is refused in one
    line, never followed, and no measurement has started."""
    folders: dict[tuple[int, str], gate.Folder] = {}
    try:
        for k in range(1, repeat + 1):
            for label in labels:
                folder = root.sub(label if repeat == 1 else f"rep{k}/{label}", create=True)
                folders[k, label] = folder
                if label in variants:
                    folder.sub(RUN, create=True).close()
    except BaseException:
        for folder in folders.values():
            folder.close()
        raise
    return folders


def _runs(bench: Bench) -> list[tuple[str, Callable[[gate.Folder], dict[str, Any]]]]:
    """What one repetition runs, in order: the floors, the Ray floors, the variants; each as
    its label and the call that runs it into a folder."""
    base, overrides = bench.base, bench.overrides
    runs: list[tuple[str, Callable[[gate.Folder], dict[str, Any]]]] = [
        (floor_label(w), partial(run_floor, base, overrides, w)) for w in bench.floors()
    ]
    if bench.ray_floor:
        runs += [
            (ray_floor_label(w), partial(run_ray_floor, base, overrides, w)) for w in bench.floors()
        ]
    runs += [(label, partial(run_variant, base, extra)) for label, extra in bench.variants.items()]
    return runs


def median_repetition(reps: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each label's result at its median end-to-end time (the lower one of an even count), with
    `ratios`: its end to end / its floor's, repetition by repetition (same repetition: run
    minutes apart, not tens of minutes), and for a variant `ray_ratios`, the same against the
    Ray floor of its worker count (when measured)."""
    combined: dict[str, dict[str, Any]] = {}
    for label in reps[0]:
        runs = sorted((rep[label] for rep in reps), key=lambda r: r["wall_s"])
        ratios, ray_ratios = [], []
        for rep in reps:
            workers = rep[label]["workers"]
            floor = rep.get(floor_label(workers))
            if floor and floor["wall_s"] > 0:
                ratios.append(rep[label]["wall_s"] / floor["wall_s"])
            ray_floor = rep.get(ray_floor_label(workers))
            if ray_floor and ray_floor["wall_s"] > 0 and not rep[label].get("floor"):
                ray_ratios.append(rep[label]["wall_s"] / ray_floor["wall_s"])
        combined[label] = {**runs[(len(runs) - 1) // 2], "ratios": ratios, "ray_ratios": ray_ratios}
    return combined


def main(argv: list[str] | None = None) -> int:
    """The benchmark's command line; `--variant`, `--floor` and `--ray-floor` are its children."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("--variant", "--floor", "--ray-floor"):
        return _child_main(argv)
    parser = argparse.ArgumentParser(
        prog="python3 experiments/benchmarks/bench.py",
        description="rayfl's engine variants on one workload, end to end, side by side",
    )
    parser.add_argument("config", help="a benchmark file (experiments/benchmarks/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every variant")
    parser.add_argument("--out", help="folder for the runs and report.txt (default: a temp dir)")
    parser.add_argument(
        "--only", nargs="+", metavar="VARIANT", help="only these variants (and their floors)"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run floors and variants N times, alternating; report medians (noisy machines)",
    )
    args = parser.parse_args(argv)
    try:
        print(run_bench(args.config, args.overrides, args.out, args.only, args.repeat))
    except UserError as exc:
        print(f"bench: error: {str(exc).strip().splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


def _child_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench.py (child)")
    child = parser.add_mutually_exclusive_group(required=True)
    child.add_argument("--variant", nargs=2, metavar=("CONFIG", "RUN_DIR"))
    child.add_argument("--floor", nargs=4, metavar=("CONFIG", "REPORT", "SHARE", "WORKERS"))
    child.add_argument("--ray-floor", nargs=3, metavar=("CONFIG", "OUT", "WORKERS"))
    args = parser.parse_args(argv)
    if args.variant:
        _variant_main(*args.variant)
    elif args.ray_floor:
        config, out, workers = args.ray_floor
        ray_floor_main(config, out, int(workers))
    else:
        config, report, share, workers = args.floor
        floor_main(config, report, int(share), int(workers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
