"""Comparison suites: several algorithms x seeds (x settings) side by side, on the same partitions.

    rayfl compare experiments/suites/pfedes_paper_fmnist.yaml
    rayfl compare experiments/suites/seed3_fmnist.yaml seeds=[0] algorithms=[local,fedproto] engine.rounds=2
    rayfl compare experiments/suites/pfedes_paper_fmnist.yaml parallel=2 --out runs/suite

A suite file:

    suite: my_suite                    # name: MLflow parent run, output folder
    base: {data: ..., model: ..., train: ..., engine: ..., tracking: ...}   # a full run config
    # or: base_file: ../pfedes_fmnist.yaml  (next to this file, the working directory, or the repository root)
    algorithms:                        # one entry per compared method
      - name: local
      - name: pfedes
        label: pfedes_input            # unique label (default: the name)
        overrides: {algorithm.variant: input}       # dotted keys; or ["algorithm.variant=input"]
    seeds: [0, 1, 2]
    settings:                          # optional: named override sets that multiply the runs
      - name: dir0.5
        overrides: {data.partition.alpha: 0.5}

Every algorithm of a setting runs on the same partition for a given seed: the partition derives
from the `data` section and the seed only, so an algorithm's overrides may not touch `data.*` or
`seed` (put such changes in `base` or a setting). Command-line overrides apply to every run,
except the suite-level `seeds=[...]`, `algorithms=[labels]` and `settings=[names]`, which select.

    parallel: 2                        # optional: runs at a time (default 1: one after another)

Runs execute `parallel` at a time: with 1, one after another in this process (each on Ray or
serially, per its `engine.executor`); with more, each run is a Ray task inside its own placement
group (a driver bundle plus one bundle per worker, which also holds the run's worker and server
actors), so runs on a cluster never hold half of what they need. Each run is an MLflow child run
under one parent run. Rerunning the same command with the same `--out` resumes: finished runs are
skipped, unfinished ones continue from their checkpoints; a failed run is recorded (status FAILED
and its error) and the others go on. Checkpoints are removed once a run finished, unless
`--keep-checkpoints`. The output folder holds every run's directory, `runs.csv|parquet` (one row
per run), `results.csv|parquet` (`<metric> [mean]` and `<metric> [std]` over seeds of every final
metric), learning-curve plots and `table.txt` (what `run_suite` returns).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import shutil
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np

from rayfl.config import (
    RunConfig,
    build_config,
    parse_override,
    read_yaml,
    resolve_base_file,
    set_dotted,
)
from rayfl.errors import ConfigError, UserError, suggest
from rayfl.safefile import read_table, write_atomic
from rayfl.tables import write_table

log = logging.getLogger(__name__)

SUITE_KEYS = (
    "suite",
    "base",
    "base_file",
    "algorithms",
    "seeds",
    "settings",
    "description",
    "parallel",
)
SELECT_KEYS = ("seeds", "algorithms", "settings")  # suite-level command-line overrides
PERSONAL = "personal/acc"
ARCH_PREFIX = "personal/acc/arch="


class SuiteRun(NamedTuple):
    """One run of a suite: the algorithm's label, the seed, the full config, the setting's name."""

    label: str
    seed: int
    config: RunConfig
    setting: str = ""


@dataclasses.dataclass(frozen=True)
class Suite:
    """A loaded, validated suite: every run's config is built and checked."""

    name: str
    runs: list[SuiteRun]
    labels: list[str]
    seeds: list[int]
    settings: list[str]  # [""] when the suite has no settings
    algorithms: dict[str, str]  # label -> algorithm name
    parallel: int = 1  # runs at a time (each reserving its workers through a placement group)


# --------------------------------------------------------------------------- loading


def _pairs(overrides: Any, key: str) -> list[tuple[list[str], Any]]:
    """Overrides given as {dotted: value} or ["dotted=value", ...] as (path, value) pairs."""
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        return [(str(k).split("."), v) for k, v in overrides.items()]
    if isinstance(overrides, list) and all(isinstance(o, str) for o in overrides):
        return [parse_override(o) for o in overrides]
    raise ConfigError(f"{key}: expected a mapping of dotted keys or a list of key=value strings")


def _base(raw: Mapping[str, Any], path: Path) -> dict[str, Any]:
    if ("base" in raw) == ("base_file" in raw):
        raise ConfigError(
            f"{path}: give exactly one of base (a run config) or base_file (a path to one)"
        )
    if "base" in raw:
        if not isinstance(raw["base"], dict):
            raise ConfigError(f"{path}: base must be a mapping (a run config without algorithm)")
        return copy.deepcopy(raw["base"])
    return read_yaml(resolve_base_file(raw["base_file"], path, "base_file"), "base_file")


def _split_cli(overrides: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    select: dict[str, Any] = {}
    rest: list[str] = []
    for text in overrides:
        keypath, value = parse_override(text)
        if keypath == ["parallel"]:
            select["parallel"] = value
        elif len(keypath) == 1 and keypath[0] in SELECT_KEYS:
            if not isinstance(value, list):
                raise ConfigError(
                    f"override {text!r}: {keypath[0]} takes a list, e.g. {keypath[0]}=[a,b]"
                )
            select[keypath[0]] = value
        elif keypath == ["seed"]:
            raise ConfigError(f"override {text!r}: a suite runs several seeds; use seeds=[0,1]")
        else:
            rest.append(text)
    return select, rest


def _pick(items: list[Any], names: list[str], wanted: Any, key: str) -> list[Any]:
    if wanted is None:
        return items
    unknown = [w for w in wanted if str(w) not in names]
    if unknown:
        raise ConfigError(
            f"{key}: {unknown[0]!r} is not in this suite{suggest(str(unknown[0]), names)}; "
            f"choose from {', '.join(names)}"
        )
    return [item for item, name in zip(items, names) if name in {str(w) for w in wanted}]


Overrides = list[tuple[list[str], Any]]


def _algorithm_entries(raw: Mapping[str, Any], path: Path) -> tuple[list[Any], list[str]]:
    """`(label, algorithm name, override pairs)` per entry of `algorithms`, and the labels."""
    entries = raw.get("algorithms")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(
            f"{path}: algorithms must be a non-empty list of {{name, label?, overrides?}}"
        )
    algos: list[tuple[str, str, Overrides]] = []
    for i, entry in enumerate(entries):
        key = f"algorithms[{i}]"
        if isinstance(entry, str):
            entry = {"name": entry}
        if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
            raise ConfigError(f"{key}: needs a name (e.g. {{name: fedproto}})")
        extra = set(entry) - {"name", "label", "overrides"}
        if extra:
            raise ConfigError(
                f"{key}: unknown key {sorted(extra)[0]!r}; valid keys: name, label, overrides"
            )
        label = str(entry.get("label") or entry["name"])
        pairs = _pairs(entry.get("overrides"), f"{key}.overrides")
        for keypath, _ in pairs:
            if keypath[0] in ("data", "seed"):
                raise ConfigError(
                    f"{key}.overrides: {'.'.join(keypath)} would give {label} a different partition "
                    "than the other algorithms; set it in base or in a setting"
                )
        algos.append((label, entry["name"], pairs))
    labels = [a[0] for a in algos]
    for label in labels:
        if labels.count(label) > 1 or "/" in label:
            raise ConfigError(
                f"{path}: algorithm label {label!r} is repeated or has a '/'; give each a unique label"
            )
    return algos, labels


def _seeds(seeds: Any, path: Path) -> list[int]:
    if (
        not isinstance(seeds, list)
        or not seeds
        or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
    ):
        raise ConfigError(f"{path}: seeds must be a non-empty list of integers, e.g. [0, 1, 2]")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"{path}: seeds {seeds} repeat a seed")
    return [int(s) for s in seeds]


def _settings(raw: Mapping[str, Any], path: Path) -> tuple[list[Any], list[str]]:
    """`(name, override pairs)` per setting (one unnamed setting when there are none), and names."""
    settings_raw = raw.get("settings") or [{"name": "", "overrides": {}}]
    if not isinstance(settings_raw, list):
        raise ConfigError(f"{path}: settings must be a list of {{name, overrides}}")
    settings: list[tuple[str, Overrides]] = []
    for i, s in enumerate(settings_raw):
        if (
            not isinstance(s, Mapping)
            or not isinstance(s.get("name"), str)
            or set(s) - {"name", "overrides"}
        ):
            raise ConfigError(f"settings[{i}]: expected {{name, overrides}}")
        if "/" in s["name"] or any(s["name"] == other[0] for other in settings):
            raise ConfigError(f"settings[{i}]: name {s['name']!r} is repeated or has a '/'")
        pairs = _pairs(s.get("overrides"), f"settings[{i}].overrides")
        if any(p == ["seed"] for p, _ in pairs):
            raise ConfigError(f"settings[{i}].overrides: use the suite's seeds, not seed")
        settings.append((s["name"], pairs))
    return settings, [s[0] for s in settings]


def load_suite(path: str | Path, overrides: Sequence[str] = ()) -> Suite:
    """Read a suite file, build and validate every run's config.

    Args:
        path: the suite YAML.
        overrides: `key=value` strings applied to every run, plus the selectors `seeds=[...]`,
            `algorithms=[labels]`, `settings=[names]`.

    Raises:
        ConfigError: a malformed suite, an invalid run config, an algorithm override that would
            change the partition, or a family an algorithm cannot use.
    """
    from rayfl.checks import check_family

    path = Path(path)
    raw = read_yaml(path, "suite file")
    unknown = [k for k in raw if k not in SUITE_KEYS]
    if unknown:
        raise ConfigError(
            f"{path}: unknown suite key {unknown[0]!r}{suggest(str(unknown[0]), SUITE_KEYS)}; "
            f"valid keys: {', '.join(SUITE_KEYS)}"
        )
    name = raw.get("suite")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{path}: suite must be a non-empty name")
    base = _base(raw, path)
    base_algorithm = base.pop("algorithm", None) or {}
    select, cli = _split_cli(overrides)

    algos = _pick(*_algorithm_entries(raw, path), select.get("algorithms"), "algorithms")
    seeds = _seeds(select.get("seeds", raw.get("seeds", [0])), path)
    settings = _pick(*_settings(raw, path), select.get("settings"), "settings")

    runs: list[SuiteRun] = []
    for setting, setting_pairs in settings:
        for label, algo_name, algo_pairs in algos:
            for seed in seeds:
                run_raw = copy.deepcopy(base)
                same = (
                    isinstance(base_algorithm, Mapping) and base_algorithm.get("name") == algo_name
                )
                run_raw["algorithm"] = dict(base_algorithm) if same else {"name": algo_name}
                for keypath, value in [*setting_pairs, *algo_pairs]:
                    set_dotted(run_raw, keypath, copy.deepcopy(value), f"{label}")
                where = f"{setting + ' / ' if setting else ''}{label}: "
                try:
                    cfg = build_config(run_raw, cli)
                    cfg = dataclasses.replace(
                        cfg,
                        name=name,
                        seed=seed,
                        tracking=dataclasses.replace(
                            cfg.tracking, run_name=run_name(setting, label, seed)
                        ),
                    )
                    check_family(cfg)
                except UserError as exc:
                    raise type(exc)(f"{path}: {where}{exc}") from None
                runs.append(SuiteRun(label, seed, cfg, setting))
    parallel = select.get("parallel", raw.get("parallel", 1))
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise ConfigError(
            f"{path}: parallel must be a whole number >= 1 (runs at a time), got {parallel!r}"
        )
    return Suite(
        name=name,
        runs=runs,
        labels=[a[0] for a in algos],
        seeds=seeds,
        settings=[s[0] for s in settings],
        algorithms={a[0]: a[1] for a in algos},
        parallel=parallel,
    )


def run_name(setting: str, label: str, seed: int) -> str:
    return f"{setting + '-' if setting else ''}{label}-s{seed}"


# --------------------------------------------------------------------------- running


def preflight(suite: Suite) -> None:
    """Checks that need the dataset's shape (feature sizes), before hours of runs start."""
    from rayfl.data.datasets import load_dataset
    from rayfl.models.families import family_from_config
    from rayfl.registry import ALGORITHMS

    shapes: dict[str, tuple[tuple[int, ...], int]] = {}
    for run in suite.runs:
        cfg = run.config
        algo = ALGORITHMS.get(cfg.algorithm.name)
        if not algo.needs_common_feature_dim:
            continue
        key = repr((cfg.data.dataset, cfg.data.root, sorted(cfg.data.options.items())))
        if key not in shapes:
            ds = load_dataset(cfg.data.dataset, cfg.data.root, **cfg.data.options)
            shapes[key] = (tuple(ds.x_train.shape[1:]), ds.num_classes)
        family = family_from_config(cfg.model.family, cfg.model.architectures)
        dims = family.feature_dims(*shapes[key])
        if len(set(dims.values())) > 1:
            raise ConfigError(
                f"{run.label}: algorithm {algo.name} needs one feature size but the family has {dims}; "
                "use a family with a common feature size (seed3, cnn5) or drop it from the suite"
            )


def _parallel_ray(suite: Suite) -> bool:
    """Parallel runs are Ray tasks whatever their executor: join or start the suite's Ray."""
    from rayfl.engine.startup import init_ray

    e = suite.runs[0].config.engine
    return init_ray(e.address, e.ray_num_cpus)


def _shared_ray(suite: Suite) -> Any:
    """Start one local Ray for all runs (instead of one per run) when they all want the same one."""
    keys = {
        (r.config.engine.address, r.config.engine.ray_num_cpus)
        for r in suite.runs
        if r.config.engine.executor == "ray"
    }
    if len(keys) != 1:
        return None
    from rayfl.engine.startup import init_ray

    address, num_cpus = keys.pop()
    return init_ray(address, num_cpus)


def _final_row(run: SuiteRun, result: Any, wall_s: float, run_dir: Path) -> dict[str, Any]:
    final = result.final
    rounds = max(1, len(result.history))
    up = final.get("comm/bytes_up_total", 0.0) / rounds / 1e6
    down = final.get("comm/bytes_down_total", 0.0) / rounds / 1e6
    row: dict[str, Any] = {
        "setting": run.setting,
        "label": run.label,
        "algorithm": run.config.algorithm.name,
        "seed": run.seed,
        "status": result.status,
        "rounds": len(result.history),
        "run_dir": str(run_dir),
        "mlflow_run_id": result.tracker_run_id or "",
        "error": "",
    }
    row.update({k: float(v) for k, v in sorted(final.items()) if k not in ("round",)})
    row["comm/mb_up_per_round"] = up
    row["comm/mb_down_per_round"] = down
    row["comm/mb_per_round"] = up + down
    row["time/wall_s"] = wall_s
    return row


ID_COLUMNS = (
    "setting",
    "label",
    "algorithm",
    "seed",
    "status",
    "rounds",
    "run_dir",
    "mlflow_run_id",
    "error",
)


def mean_col(metric: str) -> str:
    """Column of the mean over seeds of `metric` in results.parquet: `personal/acc [mean]`."""
    return f"{metric} [mean]"


def std_col(metric: str) -> str:
    """Column of the sample std over seeds (empty with one seed): `personal/acc [std]`."""
    return f"{metric} [std]"


def aggregate(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Mean and sample std (ddof=1; None for one seed) over the finished seeds of every metric.

    Returns one row per (setting, label), in first-seen order, with `<metric> [mean]` and
    `<metric> [std]` columns, `seeds` (finished runs it averages) and `failed` (runs that failed).
    """
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[(row["setting"], row["label"])].append(row)
    out: list[dict[str, Any]] = []
    for (setting, label), members in groups.items():
        done = [m for m in members if m.get("status", "FINISHED") == "FINISHED"]
        agg: dict[str, Any] = {
            "setting": setting,
            "label": label,
            "algorithm": members[0]["algorithm"],
            "seeds": len(done),
            "failed": len(members) - len(done),
        }
        metrics = sorted({k for m in done for k in m if k not in ID_COLUMNS})
        for key in metrics:
            values = np.array(
                [float(m[key]) for m in done if m.get(key) is not None], dtype=np.float64
            )
            values = values[~np.isnan(values)]
            if len(values) == 0:
                continue
            agg[mean_col(key)] = float(values.mean())
            agg[std_col(key)] = float(values.std(ddof=1)) if len(values) > 1 else None
        out.append(agg)
    return out


def mean_curves(
    histories: Mapping[str, Sequence[Sequence[Mapping[str, float]]]], key: str
) -> dict[str, list[tuple[int, float]]]:
    """Per label, the mean over seeds of `key` at each round where any seed has it."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for label, runs in histories.items():
        by_round: dict[int, list[float]] = defaultdict(list)
        for history in runs:
            for row in history:
                value = row.get(key)
                if value is not None and math.isfinite(value):
                    by_round[int(row["round"])].append(float(value))
        curves[label] = [(r, float(np.mean(v))) for r, v in sorted(by_round.items())]
    return curves


def _pm(agg: Mapping[str, Any], key: str, fmt: str = "{:.4f}") -> str:
    """`mean ± std` over seeds, or the plain value when only one seed ran."""
    mean = agg.get(mean_col(key))
    if mean is None:
        return "-"
    std = agg.get(std_col(key))
    spread = fmt.replace("+", "")  # a sign on the mean (a gain), never on the spread
    return fmt.format(mean) if std is None else f"{fmt.format(mean)} ± {spread.format(std)}"


def server_acc_keys(agg: Mapping[str, Any]) -> list[str]:
    """`<model>/acc` metrics of server-side models (global, proxy, meme, mentee, ...)."""
    keys = [k[: -len(mean_col(""))] for k in agg if k.endswith(mean_col("/acc"))]
    return sorted(k for k in keys if k.count("/") == 1 and k != PERSONAL)


PROTOCOLS = {
    "deployed": "every client, after the server step, with the model it would deploy",
    "after_fit": "the round's participants, right after local training",
}


def protocol_line(suite: Suite) -> str:
    """Which evaluation protocol (`eval.protocol`) made a suite's personalized accuracies."""
    used = sorted({run.config.eval.protocol for run in suite.runs})
    return "evaluation protocol: " + "; ".join(f"{p} ({PROTOCOLS[p]})" for p in used)


GAIN = "baseline/gain_points"


def table_rows(results: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The comparison as (header, rows) of text cells, shared by the printed table and the HTML
    report: personalized accuracy, gain over local (when measured), server-side models'
    accuracy, communication, wall time, runs."""
    gain = any(mean_col(GAIN) in r for r in results)
    header = ["algorithm", "personal acc", *(["gain over local (pts)"] if gain else [])]
    header += ["server model acc", "MB/round up+down", "wall s/run", "runs"]
    body = []
    for agg in results:
        server = ", ".join(f"{k.split('/')[0]} {_pm(agg, k)}" for k in server_acc_keys(agg)) or "-"
        runs = f"{agg['seeds']}" + (f" ({agg['failed']} FAILED)" if agg.get("failed") else "")
        body.append(
            [
                agg["label"],
                _pm(agg, PERSONAL),
                *([_pm(agg, GAIN, "{:+.2f}")] if gain else []),
                server,
                _pm(agg, "comm/mb_per_round", "{:.3f}"),
                _pm(agg, "time/wall_s", "{:.1f}"),
                runs,
            ]
        )
    return header, body


def arch_rows(results: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Personalized accuracy per architecture group as (header, rows); no columns when none."""
    suffix = mean_col("")
    archs = sorted(
        {
            k[len(ARCH_PREFIX) : -len(suffix)]
            for r in results
            for k in r
            if k.startswith(ARCH_PREFIX) and k.endswith(suffix)
        }
    )
    if not archs:
        return [], []
    body = [[agg["label"], *(_pm(agg, ARCH_PREFIX + a) for a in archs)] for agg in results]
    return ["algorithm", *archs], body


def format_results(
    suite: Suite,
    results: Sequence[Mapping[str, Any]],
    wall_s: float,
    failed: Sequence[Mapping[str, Any]] = (),
) -> str:
    """The printed comparison: one table per setting, accuracy per architecture group, and the
    runs that failed with their errors."""

    def render(header: list[str], body: list[list[str]]) -> list[str]:
        widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
        return [
            "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
            for r in [header, *body]
        ]

    spread = "mean ± std over seeds" if len(suite.seeds) > 1 else "one seed"
    lines = [
        f"suite {suite.name}: {len(suite.runs)} runs ({len(suite.labels)} algorithms x {len(suite.seeds)} seeds"
        f"{f' x {len(suite.settings)} settings' if suite.settings != [''] else ''}); "
        f"final round, {spread} {suite.seeds}; wall time {wall_s:.0f} s",
        protocol_line(suite),
    ]
    for setting in suite.settings:
        rows = [r for r in results if r["setting"] == setting]
        if not rows:
            continue
        lines.append("")
        if setting:
            lines.append(f"setting {setting}")
        lines += render(*table_rows(rows))
        header, body = arch_rows(rows)
        if header:
            lines.append("")
            lines.append("  personalized accuracy per architecture group")
            lines += render(header, body)
    if failed:
        lines.append("")
        lines.append(f"  {len(failed)} run(s) FAILED (rerun the same command to retry them):")
        for row in failed:
            lines.append(f"    {row['run_dir']}: {row['error']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- execution


def run_dir_of(out_dir: Path, run: SuiteRun) -> Path:
    return out_dir / (run.setting or ".") / run.label / f"seed{run.seed}"


def _read_history(run_dir: Path) -> list[dict[str, float]]:
    from rayfl.safefile import read_table  # a suite folder is untrusted (docs/security.md)

    return read_table(run_dir / "metrics.parquet")


def finished_row(
    run: SuiteRun, run_dir: Path, previous: Mapping[str, Mapping[str, Any]]
) -> tuple[dict[str, Any], list[dict[str, float]]] | None:
    """The row and history of a run that already FINISHED in `run_dir` (a resumed suite skips
    it), or None. `previous` holds the rows of the last runs.parquet by run directory."""
    from rayfl.engine.rundir import read_summary

    summary = read_summary(run_dir)
    if summary.get("status") != "FINISHED":
        return None
    history = _read_history(run_dir)
    old = previous.get(str(run_dir))
    if old is not None and old.get("status") == "FINISHED":
        return dict(old), history
    result = SimpleNamespace(
        final=summary.get("final", {}), history=history, status="FINISHED", tracker_run_id=None
    )
    return _final_row(run, result, float(summary.get("wall_s", 0.0)), run_dir), history


def remove_checkpoints(run_dir: Path) -> None:
    """Delete a finished run's checkpoint: the `checkpoint` link and the folders it points into."""
    link = run_dir / "checkpoint"
    if link.is_symlink() or link.is_file():
        link.unlink()
    for folder in run_dir.glob("checkpoint*"):
        shutil.rmtree(folder, ignore_errors=True)


def execute_run(
    run: SuiteRun, run_dir: Path, parent_id: str | None, keep_checkpoints: bool
) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """Run (or resume from its checkpoint) one suite run; a failure becomes a FAILED row with
    the error instead of ending the suite. Checkpoints go once it finished, unless kept."""
    from rayfl.launch import simulate

    resume = (run_dir / "checkpoint").exists()
    start = time.perf_counter()
    try:
        result = simulate(
            run.config, run_dir, progress=False, resume=resume, parent_run_id=parent_id
        )
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        log.warning("suite run %s failed: %s", run_dir, exc)
        failed = SimpleNamespace(final={}, history=[], status="FAILED", tracker_run_id=None)
        row = _final_row(run, failed, time.perf_counter() - start, run_dir)
        row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        return row, []
    row = _final_row(run, result, time.perf_counter() - start, run_dir)
    if result.status == "FINISHED" and not keep_checkpoints:
        remove_checkpoints(run_dir)
    return row, result.history


def run_bundles(cfg: RunConfig, share: float) -> tuple[list[dict[str, float]], RunConfig]:
    """Placement-group bundles for one run given `share` of the cluster's CPUs/GPUs, and the
    config with `engine.num_workers` fixed to the bundles it gets. Bundle 0 is the run's driver
    (a sliver of CPU for a Ray-executor run; the whole training for a serial one)."""
    from rayfl.config import clients_per_round

    e = cfg.engine
    w = e.worker_resources
    if e.executor == "serial":
        return [{"CPU": max(w.num_cpus, 1.0)}], cfg
    import ray

    total = ray.cluster_resources()
    room = []
    if w.num_cpus > 0:
        room.append(math.floor(total.get("CPU", 0.0) * share / w.num_cpus + 1e-9))
    if w.num_gpus > 0:
        room.append(math.floor(total.get("GPU", 0.0) * share / w.num_gpus + 1e-9))
    wanted = e.num_workers or math.ceil(clients_per_round(cfg) / e.clients_per_call)
    workers = max(1, min(wanted, *room))
    worker = {k: v for k, v in (("CPU", w.num_cpus), ("GPU", w.num_gpus)) if v > 0}
    driver = {"CPU": 0.01 + e.server_resources.num_cpus}
    if e.server_resources.num_gpus > 0:
        driver["GPU"] = e.server_resources.num_gpus
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(e, num_workers=workers))
    return [driver] + [dict(worker) for _ in range(workers)], cfg


def _execute_parallel(
    todo: list[tuple[int, SuiteRun, Path]],
    parallel: int,
    parent_id: str | None,
    keep_checkpoints: bool,
    done: Any,
) -> None:
    """Run `parallel` suite runs at a time as Ray tasks, each inside its own placement group
    (driver bundle + one bundle per worker) that also captures the run's worker and server
    actors, so runs never hold half of what they need; `done(index, row, history)` per run."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    remote = ray.remote(execute_run)
    queue = list(todo)
    running: dict[Any, tuple[int, SuiteRun, Path, Any, float]] = {}
    while queue or running:
        while queue and len(running) < parallel:
            index, run, run_dir = queue.pop(0)
            bundles, cfg = run_bundles(run.config, 1.0 / parallel)
            pg = placement_group(bundles, strategy="PACK")
            ref = remote.options(
                num_cpus=bundles[0].get("CPU", 0.0),
                num_gpus=bundles[0].get("GPU", 0.0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
                ),
            ).remote(run._replace(config=cfg), run_dir, parent_id, keep_checkpoints)
            running[ref] = (index, run, run_dir, pg, time.perf_counter())
        ready, _ = ray.wait(list(running), num_returns=1)
        index, run, run_dir, pg, started = running.pop(ready[0])
        try:
            row, history = ray.get(ready[0])
        except ray.exceptions.RayError as exc:  # the task itself died (not the run's own error)
            failed = SimpleNamespace(final={}, history=[], status="FAILED", tracker_run_id=None)
            row = _final_row(run, failed, time.perf_counter() - started, run_dir)
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:500]}"
            history = []
        finally:
            remove_placement_group(pg)
        done(index, row, history)


def run_suite(
    path: str | Path,
    overrides: Sequence[str] = (),
    out: str | Path | None = None,
    progress: bool = True,
    keep_checkpoints: bool = False,
) -> str:
    """Run every run of a suite and write the side-by-side results.

    Runs go `parallel` at a time (suite key or `parallel=N` override; default one after another).
    Rerunning the same command on the same `out` resumes: runs whose directory holds a FINISHED
    `summary.json` are skipped, unfinished ones continue from their checkpoints. A run that fails
    is recorded (status FAILED, its error) and the suite goes on.

    Args:
        path: the suite YAML.
        overrides: see `load_suite`.
        out: output folder (default `runs/suite-<name>-<time>`).
        progress: show a progress bar over the runs on stderr.
        keep_checkpoints: keep each finished run's checkpoint (default: removed once it finished).

    Returns:
        The comparison table (also written to `<out>/table.txt`).
    """
    from tqdm.auto import tqdm

    from rayfl.tracking import make_tracker
    from rayfl.tracking.plots import plot_compare

    suite = load_suite(path, overrides)
    preflight(suite)
    out_dir = (
        Path(out) if out else Path("runs") / f"suite-{suite.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(out_dir / "suite.yaml", Path(path).read_bytes())
    previous = {r["run_dir"]: r for r in read_table(out_dir / "runs.parquet")}
    first = suite.runs[0].config.tracking
    parent = make_tracker(
        first.backend,
        experiment=first.experiment,
        run_name=f"suite-{suite.name}",
        tracking_uri=first.uri,
        tags={"rayfl.suite": suite.name},
    )
    parent.log_config(
        {
            "suite": suite.name,
            "file": str(path),
            "seeds": suite.seeds,
            "labels": suite.labels,
            "algorithms": suite.algorithms,
            "settings": suite.settings,
            "overrides": list(overrides),
            "runs": len(suite.runs),
            "parallel": suite.parallel,
        }
    )
    parent_id = getattr(parent, "run_id", None)
    slots: list[tuple[dict[str, Any], list[Any]] | None] = [None] * len(suite.runs)
    todo: list[tuple[int, SuiteRun, Path]] = []
    for index, run in enumerate(suite.runs):
        run_dir = run_dir_of(out_dir, run)
        slots[index] = finished_row(run, run_dir, previous)
        if slots[index] is None:
            todo.append((index, run, run_dir))
    if len(todo) < len(suite.runs):
        log.warning(
            "suite %s: %d of %d runs already finished in %s; running the other %d",
            suite.name,
            len(suite.runs) - len(todo),
            len(suite.runs),
            out_dir,
            len(todo),
        )
    start = time.perf_counter()
    bar = tqdm(
        total=len(suite.runs),
        initial=len(suite.runs) - len(todo),
        desc=suite.name,
        unit="run",
        disable=not progress,
        dynamic_ncols=True,
    )

    def done(index: int, row: dict[str, Any], history: list[Any]) -> None:
        slots[index] = (row, history)
        # finished runs survive a later interruption
        write_table([s[0] for s in slots if s is not None], out_dir / "runs", csv=True)
        bar.update(1)

    started_ray = _shared_ray(suite) if suite.parallel == 1 else _parallel_ray(suite)
    try:
        if suite.parallel > 1 and todo:
            _execute_parallel(todo, suite.parallel, parent_id, keep_checkpoints, done)
        else:
            for index, run, run_dir in todo:
                bar.set_postfix_str(run_name(run.setting, run.label, run.seed))
                done(index, *execute_run(run, run_dir, parent_id, keep_checkpoints))
    except BaseException as exc:
        parent.close("KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
        raise
    finally:
        bar.close()
        if started_ray:
            from rayfl.engine.startup import shutdown_ray

            shutdown_ray()

    rows = [s[0] for s in slots if s is not None]
    histories: dict[str, dict[str, list[Any]]] = defaultdict(lambda: defaultdict(list))
    for run, slot in zip(suite.runs, slots):
        if slot is not None and slot[1]:
            histories[run.setting][run.label].append(slot[1])
    results = aggregate(rows)
    artifacts = write_table(rows, out_dir / "runs", csv=True) + write_table(
        results, out_dir / "results", csv=True
    )
    for setting, by_label in histories.items():
        name = f"curves_personal_acc{'_' + setting if setting else ''}.png"
        artifacts.append(
            plot_compare(mean_curves(by_label, PERSONAL), out_dir / name, ylabel=PERSONAL)
        )
    failed = [r for r in rows if r["status"] != "FINISHED"]
    table = format_results(suite, results, time.perf_counter() - start, failed)
    write_atomic(out_dir / "table.txt", (table + "\n").encode())
    artifacts.append(out_dir / "table.txt")
    for agg in results:
        prefix = f"{agg['setting'] + '/' if agg['setting'] else ''}{agg['label']}/"
        suffix = mean_col("")
        accs = {
            prefix + k[: -len(suffix)]: v
            for k, v in agg.items()
            if k.endswith(suffix)
            and v is not None
            and (k.endswith(mean_col("/acc")) or k.startswith(ARCH_PREFIX))
        }
        parent.log_metrics(accs, step=0)
    for artifact in artifacts:
        parent.log_artifact(artifact)
    parent.close("FAILED" if failed else "FINISHED")
    log.info("suite %s written to %s", suite.name, out_dir)
    return table + f"\nresults: {out_dir}"
