"""Comparison suites: several algorithms x seeds (x settings) side by side, on the same partitions.

    rayfl compare experiments/suites/pfedes_paper_fmnist.yaml
    rayfl compare experiments/suites/seed3_fmnist.yaml seeds=[0] algorithms=[local,fedproto] engine.rounds=2

A suite file:

    suite: my_suite                    # name: MLflow parent run, output folder
    base: {data: ..., model: ..., train: ..., engine: ..., tracking: ...}   # a full run config
    # or: base_file: ../pfedes_fmnist.yaml  (relative to this file, or to the working directory)
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

Runs execute one after another (each on Ray or serially, per its `engine.executor`), each as an
MLflow child run under one parent run. The output folder holds every run's directory,
`runs.csv|parquet` (one row per run), `results.csv|parquet` (mean and std over seeds of every
final metric), learning-curve plots and `table.txt` (what `run_suite` returns).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
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
from rayfl.tables import write_table

log = logging.getLogger(__name__)

SUITE_KEYS = ("suite", "base", "base_file", "algorithms", "seeds", "settings", "description")
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
        if len(keypath) == 1 and keypath[0] in SELECT_KEYS:
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
    return Suite(
        name=name,
        runs=runs,
        labels=[a[0] for a in algos],
        seeds=seeds,
        settings=[s[0] for s in settings],
        algorithms={a[0]: a[1] for a in algos},
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


def _shared_ray(suite: Suite) -> Any:
    """Start one local Ray for all runs (instead of one per run) when they all want the same one."""
    keys = {
        (r.config.engine.address, r.config.engine.ray_num_cpus)
        for r in suite.runs
        if r.config.engine.executor == "ray"
    }
    if len(keys) != 1:
        return None
    from rayfl.engine.executor import init_ray

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
)


def aggregate(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Mean and std (sample std, ddof=1; 0 for one seed) over seeds of every numeric metric.

    Returns one row per (setting, label), in first-seen order, with `<metric>_mean`,
    `<metric>_std` columns and `seeds` (how many runs it averages).
    """
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[(row["setting"], row["label"])].append(row)
    out: list[dict[str, Any]] = []
    for (setting, label), members in groups.items():
        agg: dict[str, Any] = {
            "setting": setting,
            "label": label,
            "algorithm": members[0]["algorithm"],
            "seeds": len(members),
        }
        metrics = sorted({k for m in members for k in m if k not in ID_COLUMNS})
        for key in metrics:
            values = np.array(
                [float(m[key]) for m in members if m.get(key) is not None], dtype=np.float64
            )
            if len(values) == 0:
                continue
            agg[f"{key}_mean"] = float(values.mean())
            agg[f"{key}_std"] = float(values.std(ddof=1)) if len(values) > 1 else 0.0
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
    if f"{key}_mean" not in agg:
        return "-"
    return f"{fmt.format(agg[f'{key}_mean'])} ± {fmt.format(agg[f'{key}_std'])}"


def server_acc_keys(agg: Mapping[str, Any]) -> list[str]:
    """`<model>/acc` metrics of server-side models (global, proxy, meme, mentee, ...)."""
    keys = [k[: -len("_mean")] for k in agg if k.endswith("/acc_mean")]
    return sorted(k for k in keys if k.count("/") == 1 and k != PERSONAL)


def format_results(suite: Suite, results: Sequence[Mapping[str, Any]], wall_s: float) -> str:
    """The printed comparison: one table per setting, then accuracy per architecture group."""

    def render(header: list[str], body: list[list[str]]) -> list[str]:
        widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
        return [
            "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
            for r in [header, *body]
        ]

    lines = [
        f"suite {suite.name}: {len(suite.runs)} runs ({len(suite.labels)} algorithms x {len(suite.seeds)} seeds"
        f"{f' x {len(suite.settings)} settings' if suite.settings != [''] else ''}); "
        f"final round, mean ± std over seeds {suite.seeds}; wall time {wall_s:.0f} s"
    ]
    for setting in suite.settings:
        rows = [r for r in results if r["setting"] == setting]
        if not rows:
            continue
        lines.append("")
        if setting:
            lines.append(f"setting {setting}")
        header = ["algorithm", "personal/acc", "server model acc", "MB/round up+down", "wall s/run"]
        body = []
        for agg in rows:
            server = (
                ", ".join(f"{k.split('/')[0]} {_pm(agg, k)}" for k in server_acc_keys(agg)) or "-"
            )
            body.append(
                [
                    agg["label"],
                    _pm(agg, PERSONAL),
                    server,
                    _pm(agg, "comm/mb_per_round", "{:.3f}"),
                    _pm(agg, "time/wall_s", "{:.1f}"),
                ]
            )
        lines += render(header, body)
        archs = sorted(
            {
                k[len(ARCH_PREFIX) : -len("_mean")]
                for r in rows
                for k in r
                if k.startswith(ARCH_PREFIX) and k.endswith("_mean")
            }
        )
        if archs:
            lines.append("")
            lines.append("  personalized accuracy per architecture group")
            body = [[agg["label"], *(_pm(agg, ARCH_PREFIX + a) for a in archs)] for agg in rows]
            lines += render(["algorithm", *archs], body)
    return "\n".join(lines)


def run_suite(
    path: str | Path,
    overrides: Sequence[str] = (),
    out: str | Path | None = None,
    progress: bool = True,
) -> str:
    """Run every run of a suite one after another and write the side-by-side results.

    Args:
        path: the suite YAML.
        overrides: see `load_suite`.
        out: output folder (default `runs/suite-<name>-<time>`).
        progress: show a progress bar over the runs on stderr.

    Returns:
        The comparison table (also written to `<out>/table.txt`).
    """
    from tqdm.auto import tqdm

    from rayfl.launch import simulate
    from rayfl.tracking import make_tracker
    from rayfl.tracking.plots import plot_compare

    suite = load_suite(path, overrides)
    preflight(suite)
    out_dir = (
        Path(out) if out else Path("runs") / f"suite-{suite.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "suite.yaml").write_text(Path(path).read_text())
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
        }
    )
    parent_id = getattr(parent, "run_id", None)
    started_ray = _shared_ray(suite)
    rows: list[dict[str, Any]] = []
    histories: dict[str, dict[str, list[Any]]] = defaultdict(lambda: defaultdict(list))
    start = time.perf_counter()
    bar = tqdm(
        total=len(suite.runs), desc=suite.name, unit="run", disable=not progress, dynamic_ncols=True
    )
    try:
        for run in suite.runs:
            bar.set_postfix_str(run_name(run.setting, run.label, run.seed))
            run_dir = out_dir / (run.setting or ".") / run.label / f"seed{run.seed}"
            t0 = time.perf_counter()
            result = simulate(run.config, run_dir, progress=False, parent_run_id=parent_id)
            rows.append(_final_row(run, result, time.perf_counter() - t0, run_dir))
            histories[run.setting][run.label].append(result.history)
            write_table(rows, out_dir / "runs", csv=True)  # finished runs survive a later failure
            bar.update(1)
    except BaseException as exc:
        parent.close("KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
        raise
    finally:
        bar.close()
        if started_ray:
            import ray

            ray.shutdown()

    results = aggregate(rows)
    artifacts = write_table(rows, out_dir / "runs", csv=True) + write_table(
        results, out_dir / "results", csv=True
    )
    for setting, by_label in histories.items():
        name = f"curves_personal_acc{'_' + setting if setting else ''}.png"
        artifacts.append(
            plot_compare(mean_curves(by_label, PERSONAL), out_dir / name, ylabel=PERSONAL)
        )
    table = format_results(suite, results, time.perf_counter() - start)
    (out_dir / "table.txt").write_text(table + "\n")
    artifacts.append(out_dir / "table.txt")
    for agg in results:
        prefix = f"{agg['setting'] + '/' if agg['setting'] else ''}{agg['label']}/"
        accs = {
            prefix + k[: -len("_mean")]: v
            for k, v in agg.items()
            if k.endswith("/acc_mean") or (k.startswith(ARCH_PREFIX) and k.endswith("_mean"))
        }
        parent.log_metrics(accs, step=0)
    for artifact in artifacts:
        parent.log_artifact(artifact)
    parent.close("FINISHED")
    log.info("suite %s written to %s", suite.name, out_dir)
    return table + f"\nresults: {out_dir}"
