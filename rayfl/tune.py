"""`rayfl tune`: a sweep file becomes a Ray Tune `Tuner`; each trial is one simulation in its own
placement group, reporting every round (so ASHA can stop it early) and logging an MLflow child run
under the sweep's parent run.

    rayfl tune experiments/sweeps/pfedes_T_alpha.yaml
    rayfl tune experiments/sweeps/pfedes_T_alpha.yaml tune.num_samples=4 tune.scheduler=asha
    rayfl tune experiments/sweeps/pfedes_T_alpha.yaml engine.rounds=5 --out runs/sweeps/x

A sweep file::

    sweep: pfedes_T_alpha                  # name: Tune experiment, MLflow parent run
    base: experiments/pfedes_fmnist.yaml   # relative to the sweep file, the cwd or the repository
    overrides: [engine.rounds=3]           # applied to the base experiment
    space:                                 # dotted config key -> one distribution
      algorithm.T: {grid: [2.0, 4.0]}      # every value (a grid multiplies the trials)
      algorithm.alpha: {loguniform: [0.01, 1.0]}
      algorithm.embed_dim: {choice: [64, 128]}
      #   also {uniform: [lo, hi]} and {randint: [lo, hi]} (both ends included)
    tune: {metric: personal/acc, mode: max, num_samples: 1, scheduler: null, max_concurrent: 2}

Command-line overrides: `tune.<key>=...` sets the `tune:` section, `space.<dotted key>={grid: [..]}`
adds or replaces one space entry, and every other `key=value` goes to the base experiment after the
file's own `overrides` (e.g. `engine.rounds=5`).

Outputs under `--out` (default `runs/sweeps/<sweep>-<time>`): `tune/` (Tune's own experiment
state; rerunning with `tune.resume=true` continues it), `trials/<trial>/` (each trial's run
directory and checkpoints), `results.parquet` (one row per trial), `best_config.yaml` (the best
trial's experiment, ready for `rayfl run`) and `metric_vs_params.png`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml

from rayfl.config import (
    RunConfig,
    apply_overrides,
    build_config,
    from_dict,
    parse_override,
    read_yaml,
    set_dotted,
    to_dict,
)
from rayfl.engine.callbacks import Callback
from rayfl.errors import ConfigError, UserError, require, suggest

log = logging.getLogger(__name__)

SPEC_KINDS = ("grid", "choice", "uniform", "loguniform", "randint")
SWEEP_KEYS = ("sweep", "base", "description", "overrides", "space", "tune")
REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class TuneSettings:
    """The `tune:` section of a sweep file."""

    metric: str = (
        "personal/acc"  # a per-round metric of the simulation (its last value ranks trials)
    )
    mode: Literal["max", "min"] = "max"
    num_samples: int = 1  # repeats of the grid; each repeat draws the random distributions anew
    scheduler: Literal["asha"] | None = None  # asha: stop poor trials early, by round
    max_concurrent: int = 2  # trials running at once (placement groups also limit it)
    grace_period: int = 1  # asha: rounds every trial runs before it can be stopped
    reduction_factor: float = 2.0  # asha: keep the best 1/reduction_factor at each rung
    trial_cpus: float = 0.5  # the trial's own process with engine.executor=ray (it mostly waits)
    seed: int | None = 0  # random search draws are reproducible for a given seed (None: not)
    resume: bool = False  # continue the Tune experiment already in <out>/tune
    verbose: int = 1  # Tune's console output: 0 silent, 1 status updates, 2 every result
    # where Tune keeps the experiment (trial state, checkpoints): a path or a URI such as
    # s3://bucket/rayfl-sweeps that every node reaches (None: <out>/tune on the driver's node)
    storage: str | None = None


@dataclass(frozen=True)
class Sweep:
    """A validated sweep: the base experiment, its overrides, the search space and Tune settings.

    Attributes:
        name: The sweep's name (Tune experiment and MLflow parent run).
        path: The sweep file.
        base: The resolved base experiment file.
        raw: The base experiment file as a nested dict (before overrides).
        overrides: The sweep file's overrides, then the command line's base overrides.
        space: Dotted config key -> `{kind: args}`, e.g. `{"algorithm.T": {"grid": [2, 4]}}`.
        tune: The Tune settings.
        config: The base experiment with all overrides, validated.
    """

    name: str
    path: Path
    base: Path
    raw: dict[str, Any]
    overrides: tuple[str, ...]
    space: dict[str, dict[str, Any]]
    tune: TuneSettings
    config: RunConfig
    description: str = ""

    def config_for(self, values: Mapping[str, Any]) -> RunConfig:
        """The experiment of one trial: the base config with `values` (dotted key -> value) set.

        Values win over overrides of the same key. Raises ConfigError when a value is invalid.
        """
        values = {k: _native(v) for k, v in values.items()}
        raw = apply_overrides(self.raw, [])
        overrides = [o for o in self.overrides if _override_key(o) not in values]
        for key, value in values.items():
            set_dotted(raw, key.split("."), value, f"space.{key}")
        if "algorithm.name" in values:
            # build_config drops the file's settings of another algorithm only when the name
            # arrives as an override, so a swept algorithm name is passed that way too.
            overrides.append(f"algorithm.name={values['algorithm.name']}")
        return build_config(raw, overrides)

    def fingerprint(self) -> dict[str, Any]:
        """What must not change between a sweep and its resumption."""
        settings = dataclasses.asdict(self.tune)
        for key in ("resume", "verbose", "max_concurrent", "storage"):
            settings.pop(key)
        return {
            "name": self.name,
            "base": str(self.base),
            "overrides": list(self.overrides),
            "space": self.space,
            "tune": settings,
        }


# --------------------------------------------------------------------------- loading


def _native(value: Any) -> Any:
    """numpy scalars (Tune's random draws) -> Python scalars, so configs and YAML accept them."""
    if isinstance(value, np.generic):
        return value.item()
    return value


def _override_key(text: str) -> str:
    return text.split("=", 1)[0].strip()


def split_overrides(overrides: Sequence[str]) -> tuple[list[str], dict[str, Any], list[str]]:
    """Route command-line overrides: (`tune.*` overrides, `space.*` entries, base overrides).

    Example:
        >>> split_overrides(["tune.num_samples=4", "space.seed={grid: [0, 1]}", "engine.rounds=3"])
        (['num_samples=4'], {'seed': {'grid': [0, 1]}}, ['engine.rounds=3'])
    """
    tune_ov: list[str] = []
    space_ov: dict[str, Any] = {}
    base_ov: list[str] = []
    for text in overrides:
        key = _override_key(text)
        if key.startswith("tune."):
            tune_ov.append(text.split(".", 1)[1])
        elif key.startswith("space."):
            _, value = parse_override(text)
            space_ov[key[len("space.") :]] = value
        else:
            base_ov.append(text)
    return tune_ov, space_ov, base_ov


def _resolve_base(base: Any, sweep_path: Path) -> Path:
    if not isinstance(base, str) or not base:
        raise ConfigError(
            f"{sweep_path}: base: name the experiment file to sweep over (e.g. experiments/pfedes_fmnist.yaml)"
        )
    path = Path(base).expanduser()
    candidates = (
        [path]
        if path.is_absolute()
        else [sweep_path.parent / path, Path.cwd() / path, REPO_ROOT / path]
    )
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise ConfigError(
        f"{sweep_path}: base: {base} not found (looked in {', '.join(str(c.parent) for c in candidates)}); "
        "give a path relative to the sweep file or the repository root"
    )


def _check_spec(key: str, spec: Any) -> dict[str, Any]:
    """Check one space entry's shape; returns it as a plain `{kind: args}` dict."""
    where = f"space.{key}"
    if not isinstance(spec, Mapping) or len(spec) != 1:
        raise ConfigError(
            f"{where}: write one distribution, e.g. {{grid: [1, 2]}} ({', '.join(SPEC_KINDS)})"
        )
    kind, args = next(iter(spec.items()))
    if kind not in SPEC_KINDS:
        raise ConfigError(
            f"{where}: unknown distribution {kind!r}{suggest(str(kind), SPEC_KINDS)}; choose one of {', '.join(SPEC_KINDS)}"
        )
    if kind in ("grid", "choice"):
        require(
            isinstance(args, list) and len(args) > 0,
            where,
            f"{kind} needs a non-empty list of values",
        )
    else:
        ok = (
            isinstance(args, list)
            and len(args) == 2
            and all(isinstance(a, int | float) and not isinstance(a, bool) for a in args)
        )
        require(ok, where, f"{kind} needs [low, high] numbers")
        lo, hi = args
        require(lo < hi, where, f"{kind} needs low < high (got {lo}, {hi})")
        if kind == "loguniform":
            require(lo > 0, where, f"loguniform needs low > 0 (got {lo})")
        if kind == "randint":
            require(
                isinstance(lo, int) and isinstance(hi, int), where, "randint needs integer bounds"
            )
    return {str(kind): list(args)}


def _probe_values(spec: dict[str, Any]) -> list[Any]:
    """Values that stand for a distribution when checking it against the config schema."""
    kind, args = next(iter(spec.items()))
    if kind in ("grid", "choice"):
        return list(args)
    lo, hi = args
    if kind == "randint":
        return [lo, hi]
    # Draws between the bounds are fractional: an integer key such as algorithm.embed_dim must
    # refuse a fractional probe here, not in the middle of the sweep.
    half = math.floor(lo) + 0.5
    return [lo, hi, half if lo < half < hi else (lo + hi) / 2]


def load_sweep(path: str | Path, overrides: Sequence[str] = ()) -> Sweep:
    """Load and validate a sweep file without running anything.

    Every space key is checked by building the base experiment with each probe value of its
    distribution (every grid/choice value, the bounds of ranges).

    Args:
        path: The sweep YAML.
        overrides: `tune.*=`, `space.<key>=` and base `key=value` overrides (see the module doc).

    Returns:
        The validated sweep.

    Raises:
        ConfigError: An unknown or invalid key or value, naming it (`space.<key>: ...`).
    """
    path = Path(path)
    doc = read_yaml(path, "sweep file")
    for key in doc:
        if key not in SWEEP_KEYS:
            raise ConfigError(
                f"{path}: unknown key {key}{suggest(str(key), SWEEP_KEYS)}; valid keys: {', '.join(SWEEP_KEYS)}"
            )
    name = doc.get("sweep")
    if not isinstance(name, str) or not re.fullmatch(r"[\w.-]+", name):
        raise ConfigError(
            f"{path}: sweep: give the sweep a name of letters, digits, _ . - (got {name!r})"
        )
    tune_ov, space_ov, base_ov = split_overrides(overrides)

    tune_raw = apply_overrides(dict(doc.get("tune") or {}), tune_ov)
    settings = from_dict(TuneSettings, tune_raw, prefix="tune.")
    _check_settings(settings)

    file_overrides = doc.get("overrides") or []
    if not isinstance(file_overrides, list) or not all(isinstance(o, str) for o in file_overrides):
        raise ConfigError(
            f"{path}: overrides: write a list of key=value strings (e.g. [engine.rounds=3])"
        )
    space_doc = doc.get("space") or {}
    if not isinstance(space_doc, Mapping):
        raise ConfigError(
            f"{path}: space: map dotted config keys to distributions (e.g. algorithm.T: {{grid: [2, 4]}})"
        )
    space_raw = {**space_doc, **space_ov}
    if not space_raw:
        raise ConfigError(
            f"{path}: space: is empty; sweep at least one key (e.g. algorithm.T: {{grid: [2, 4]}})"
        )
    space = {str(k): _check_spec(str(k), v) for k, v in space_raw.items()}

    base = _resolve_base(doc.get("base"), path)
    raw = read_yaml(base, "base experiment")
    all_overrides = tuple(file_overrides) + tuple(base_ov)
    config = build_config(raw, all_overrides)
    sweep = Sweep(
        name=name,
        path=path.resolve(),
        base=base,
        raw=raw,
        overrides=all_overrides,
        space=space,
        tune=settings,
        config=config,
        description=str(doc.get("description") or ""),
    )
    for key, spec in space.items():
        for value in _probe_values(spec):
            try:
                sweep.config_for({key: value})
            except ConfigError as exc:
                raise ConfigError(f"space.{key}: {exc}") from None
    from rayfl.checks import check_family

    check_family(config)
    return sweep


def _check_settings(t: TuneSettings) -> None:
    require(bool(t.metric), "tune.metric", "name the metric that ranks trials (e.g. personal/acc)")
    require(t.num_samples >= 1, "tune.num_samples", f"must be at least 1 (got {t.num_samples})")
    require(
        t.max_concurrent >= 1, "tune.max_concurrent", f"must be at least 1 (got {t.max_concurrent})"
    )
    require(
        t.grace_period >= 1, "tune.grace_period", f"must be at least 1 round (got {t.grace_period})"
    )
    require(
        t.reduction_factor > 1, "tune.reduction_factor", f"must be > 1 (got {t.reduction_factor})"
    )
    require(t.trial_cpus > 0, "tune.trial_cpus", f"must be > 0 (got {t.trial_cpus})")
    require(t.verbose in (0, 1, 2, 3), "tune.verbose", "must be 0, 1, 2 or 3")


# --------------------------------------------------------------------------- search space & resources


def search_space(space: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Tune's `param_space` for the sweep's space (flat: dotted keys stay keys)."""
    from ray import tune

    out: dict[str, Any] = {}
    for key, spec in space.items():
        kind, args = next(iter(spec.items()))
        if kind == "grid":
            out[key] = tune.grid_search(list(args))
        elif kind == "choice":
            out[key] = tune.choice(list(args))
        elif kind == "uniform":
            out[key] = tune.uniform(*args)
        elif kind == "loguniform":
            out[key] = tune.loguniform(*args)
        else:  # randint: Tune's upper bound is exclusive, ours inclusive
            out[key] = tune.randint(args[0], args[1] + 1)
    return out


def num_trials(sweep: Sweep) -> int:
    """How many trials the sweep starts: grid sizes multiplied, times `tune.num_samples`."""
    grid = math.prod(len(s["grid"]) for s in sweep.space.values() if "grid" in s)
    return grid * sweep.tune.num_samples


def trial_workers(cfg: RunConfig) -> int:
    """Worker actors of one trial with engine.executor=ray: engine.num_workers, else 1."""
    return cfg.engine.num_workers or 1


def trial_bundles(cfg: RunConfig, trial_cpus: float) -> list[dict[str, float]]:
    """The placement-group bundles one trial reserves.

    With `engine.executor=serial` the trial process trains every client itself, so it reserves one
    worker's resources. With `ray` it reserves `trial_cpus` for its own (mostly waiting) process,
    one bundle per worker actor, and one for the server actor when that asks for resources; the
    actors the trial starts land in these bundles, so concurrent trials never oversubscribe.

    Example:
        >>> from rayfl.config import build_config
        >>> cfg = build_config({"algorithm": {"name": "local"}}, ["engine.num_workers=2"])
        >>> trial_bundles(cfg, 0.5)
        [{'CPU': 0.5}, {'CPU': 1.0}, {'CPU': 1.0}]
    """
    e = cfg.engine

    def bundle(res: Any) -> dict[str, float]:
        return {k: float(v) for k, v in (("CPU", res.num_cpus), ("GPU", res.num_gpus)) if v > 0}

    if e.executor == "serial":
        return [bundle(e.worker_resources)]
    bundles = [{"CPU": float(trial_cpus)}]
    bundles += [bundle(e.worker_resources) for _ in range(trial_workers(cfg))]
    server = bundle(e.server_resources)
    if server:
        bundles.append(server)
    return bundles


def _trial_resources(sweep: Sweep, config: dict[str, Any]) -> Any:
    from ray import tune

    return tune.PlacementGroupFactory(
        trial_bundles(sweep.config_for(config), sweep.tune.trial_cpus)
    )


def _check_fits(sweep: Sweep, strict: bool) -> None:
    """Refuse (strict: a private local Ray) or warn when one trial cannot fit the cluster."""
    import ray

    bundles = trial_bundles(sweep.config, sweep.tune.trial_cpus)
    total = ray.cluster_resources()
    for res in ("CPU", "GPU"):
        need = sum(b.get(res, 0.0) for b in bundles)
        have = total.get(res, 0.0)
        if need > have + 1e-9:
            msg = (
                f"one trial reserves {need:g} {res} ({len(bundles)} bundles: {bundles}) but the cluster has "
                f"{have:g}; lower engine.num_workers or engine.worker_resources, or use engine.executor=serial"
            )
            if strict:
                raise UserError(msg)
            log.warning("%s; Tune waits for the autoscaler to add nodes", msg)


# --------------------------------------------------------------------------- trials


class TuneReport(Callback):
    """Reports every evaluated round's metrics to Tune (ASHA stops trials by `round`).

    Rounds without the ranking metric (engine.eval_every > 1) are not reported: Tune refuses
    results without it. Missing at the last round means a wrong `tune.metric`: that is an error.
    """

    def __init__(self, metric: str, report: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.metric = metric
        self._report = report

    def on_round_end(self, sim: Any, round_idx: int, metrics: dict[str, float]) -> None:
        if self.metric not in metrics:
            if round_idx >= sim.cfg.engine.rounds:
                raise ConfigError(
                    f"tune.metric: {self.metric!r} is not a metric of this run{suggest(self.metric, metrics)}; "
                    f"available: {', '.join(sorted(metrics))}"
                )
            return
        report = self._report
        if report is None:
            from ray import tune

            report = tune.report
        result = {k: float(v) for k, v in metrics.items()}
        result["round"] = float(round_idx)
        report(result)


@dataclass(frozen=True)
class TrialJob:
    """Everything a trial needs, shipped to it once through the object store."""

    sweep: Sweep
    out: Path
    tracking_uri: str | None  # None: trials do not track
    parent_run_id: str | None
    data_root: str | None  # made absolute on the driver (trials run in their own directories)


def trial_config(job: TrialJob, values: Mapping[str, Any], trial_name: str) -> RunConfig:
    """One trial's experiment: the swept values plus what a trial must have (tracking, workers)."""
    cfg = job.sweep.config_for(values)
    extra: dict[str, Any] = {"tracking.run_name": trial_name}
    if job.tracking_uri is None:
        extra["tracking.backend"] = "none"
    else:
        extra["tracking.backend"] = "mlflow"
        extra["tracking.uri"] = job.tracking_uri
    if job.data_root is not None:
        extra["data.root"] = job.data_root
    if cfg.engine.executor == "ray":
        # The worker count must match the bundles reserved for this trial; the trial joins the
        # running Ray (engine.address is ignored once Ray is initialized).
        extra["engine.num_workers"] = trial_workers(cfg)
    return job.sweep.config_for({**values, **extra})


def _trainable(config: dict[str, Any], job: TrialJob) -> None:
    """Tune's function trainable: one simulation, reporting after every evaluated round."""
    from ray import tune

    from rayfl.launch import simulate

    name = tune.get_context().get_trial_name()
    cfg = trial_config(job, config, name)
    run_dir = job.out / "trials" / name
    # A restored sweep restarts an unfinished trial; its own checkpoint lets it continue.
    resume = (run_dir / "checkpoint" / "meta.json").exists()
    simulate(
        cfg,
        run_dir,
        progress=False,
        resume=resume,
        parent_run_id=job.parent_run_id,
        extra_callbacks=[TuneReport(job.sweep.tune.metric)],
    )


def _trial_name(trial: Any) -> str:
    return f"trial_{trial.trial_id}"


# --------------------------------------------------------------------------- MLflow parent run


class ParentRun:
    """The sweep's MLflow parent run; reopened (not duplicated) when the sweep resumes."""

    def __init__(self, sweep: Sweep, uri: str, run_id: str | None) -> None:
        from mlflow import MlflowClient

        from rayfl.tracking.mlflow import prepare_experiment

        experiment = sweep.config.tracking.experiment
        experiment_id = prepare_experiment(experiment, uri)
        self.client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        self.experiment = experiment
        self.run_id = ""
        if run_id:
            try:
                self.client.update_run(run_id, status="RUNNING")
                self.run_id = run_id
            except Exception as exc:
                log.warning(
                    "cannot reopen MLflow parent run %s (%s); starting a new one", run_id, exc
                )
        if not self.run_id:
            tags = {"rayfl.sweep": sweep.name, "rayfl.base": str(sweep.base)}
            run = self.client.create_run(experiment_id, run_name=sweep.name, tags=tags)
            self.run_id = run.info.run_id
            self._safe(self._log_params, sweep)

    def _log_params(self, sweep: Sweep) -> None:
        from mlflow.entities import Param

        from rayfl.tracking.mlflow import mlflow_key

        params = {f"space.{k}": json.dumps(v) for k, v in sweep.space.items()}
        params.update({f"tune.{k}": str(v) for k, v in dataclasses.asdict(sweep.tune).items()})
        params["base"] = str(sweep.base)
        params["overrides"] = " ".join(sweep.overrides)[:6000]
        items = [Param(mlflow_key(k), v) for k, v in params.items()]
        self.client.log_batch(self.run_id, params=items, synchronous=True)

    def _safe(self, fn: Callable[..., Any], *args: Any) -> None:
        # A tracking outage must not lose a finished sweep's results (they are on disk too).
        try:
            fn(*args)
        except Exception as exc:
            log.warning(
                "MLflow parent run %s: %s failed (%s)",
                self.run_id,
                getattr(fn, "__name__", fn),
                exc,
            )

    def log_artifacts(self, paths: Sequence[Path]) -> None:
        for path in paths:
            self._safe(self.client.log_artifact, self.run_id, str(path))

    def log_metrics(self, metrics: Mapping[str, float]) -> None:
        from rayfl.tracking.mlflow import mlflow_key

        for key, value in metrics.items():
            self._safe(self.client.log_metric, self.run_id, mlflow_key(key), float(value))

    def close(self, status: str) -> None:
        self._safe(self._kill_orphans)
        self._safe(self.client.set_terminated, self.run_id, status)

    def _kill_orphans(self) -> None:
        """Trials that Tune stopped (ASHA) or lost end without closing their child run."""
        runs = self.client.search_runs(
            [self.client.get_run(self.run_id).info.experiment_id],
            filter_string=f"tags.mlflow.parentRunId = '{self.run_id}' and attributes.status = 'RUNNING'",
        )
        for run in runs:
            self.client.set_terminated(run.info.run_id, "KILLED")

    def child_runs(self) -> list[Any]:
        """The trial runs under this parent (for reports and tests)."""
        return list(
            self.client.search_runs(
                [self.client.get_run(self.run_id).info.experiment_id],
                filter_string=f"tags.mlflow.parentRunId = '{self.run_id}'",
            )
        )


# --------------------------------------------------------------------------- results


@dataclass
class SweepResult:
    """What a sweep produced (also written under `out`)."""

    sweep: Sweep
    out: Path
    rows: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] | None = None
    best_config_path: Path | None = None
    parent_run_id: str | None = None
    tracking_uri: str | None = None
    wall_s: float = 0.0


def _collect(grid: Any, sweep: Sweep) -> list[dict[str, Any]]:
    """One row per trial: trial, swept values, metric (last reported), rounds, status, error."""
    metric = sweep.tune.metric
    rounds = sweep.config.engine.rounds
    rows = []
    for result in grid:
        metrics = result.metrics or {}
        name = Path(result.path).name if result.path else str(metrics.get("trial_id", "?"))
        row: dict[str, Any] = {"trial": name}
        for key in sweep.space:
            row[key] = _native(result.config.get(key)) if result.config else None
        value = metrics.get(metric)
        row[metric] = float(value) if value is not None else None
        row["rounds"] = int(metrics.get("round", 0))
        wanted = int(result.config.get("engine.rounds", rounds)) if result.config else rounds
        if result.error is not None:
            row["status"] = "error"
            row["error"] = (
                str(result.error).strip().splitlines()[-1][:300]
                if str(result.error).strip()
                else type(result.error).__name__
            )
        else:
            row["status"] = "done" if row["rounds"] >= wanted else "stopped"
            row["error"] = ""
        rows.append(row)
    rows.sort(key=lambda r: r["trial"])
    return rows


def _best(rows: list[dict[str, Any]], metric: str, mode: str) -> dict[str, Any] | None:
    scored = [
        r
        for r in rows
        if r["status"] != "error" and r[metric] is not None and math.isfinite(r[metric])
    ]
    if not scored:
        return None
    pick = max if mode == "max" else min
    return pick(scored, key=lambda r: r[metric])


def write_results(rows: list[dict[str, Any]], path: Path) -> Path:
    """Rows -> Parquet; a column mixing types (a grid of names and numbers) is written as text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns: dict[str, Any] = {}
    for key in rows[0] if rows else []:
        values = [r.get(key) for r in rows]
        try:
            columns[key] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            columns[key] = pa.array([None if v is None else str(v) for v in values])
    pq.write_table(pa.table(columns), path)
    return path


def write_best_config(result: SweepResult) -> Path:
    """The best trial's experiment as YAML that `rayfl run` loads unchanged."""
    assert result.best is not None
    sweep, best = result.sweep, result.best
    values = {k: best[k] for k in sweep.space}
    cfg = sweep.config_for(values)
    path = result.out / "best_config.yaml"
    chosen = ", ".join(f"{k}={v}" for k, v in values.items())
    header = (
        f"# Best trial {best['trial']} of sweep {sweep.name} ({sweep.path}):\n"
        f"#   {sweep.tune.metric} = {best[sweep.tune.metric]:.4f} ({sweep.tune.mode}) with {chosen}\n"
        f"# Base experiment {sweep.base} with the sweep's overrides and these values.\n"
        f"#   rayfl run {path}\n"
    )
    path.write_text(header + yaml.safe_dump(to_dict(cfg), sort_keys=False))
    return path


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if math.isfinite(value) else str(value)
    return "-" if value is None else str(value)


def format_results(result: SweepResult) -> str:
    """The printed report: a table of trials, the best trial, where the outputs are."""
    sweep, rows = result.sweep, result.rows
    metric = sweep.tune.metric
    cols = ["trial", *sweep.space, metric, "rounds", "status"]
    cells = [cols] + [[_fmt(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(cols))]
    counts = {s: sum(r["status"] == s for r in rows) for s in ("done", "stopped", "error")}
    lines = [
        f"sweep {sweep.name}: {len(rows)} trials ({counts['done']} done, {counts['stopped']} stopped early, "
        f"{counts['error']} failed), {metric} ({sweep.tune.mode}), {result.wall_s:.1f} s"
    ]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in cells]
    for r in rows:
        if r["status"] == "error":
            lines.append(f"  {r['trial']} failed: {r['error']}")
    if result.best is not None:
        chosen = ", ".join(f"{k}={_fmt(result.best[k])}" for k in sweep.space)
        lines.append(
            f"best: {result.best['trial']} {metric}={result.best[metric]:.4f} with {chosen}"
        )
        lines.append(
            f"best config: {result.best_config_path}  (rayfl run {result.best_config_path})"
        )
    lines.append(f"results: {result.out / 'results.parquet'}")
    if result.parent_run_id:
        lines.append(
            f"MLflow parent run {result.parent_run_id} in experiment "
            f"{sweep.config.tracking.experiment} at {result.tracking_uri}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- running


def default_out(sweep: Sweep) -> Path:
    return Path("runs") / "sweeps" / f"{sweep.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _absolute_uri(uri: str | None) -> str:
    """Trials run in their own directories: a relative SQLite path must become absolute."""
    from rayfl.tracking.base import default_tracking_uri

    uri = uri or default_tracking_uri()
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        return prefix + str((Path.cwd() / uri[len(prefix) :]).resolve())
    return uri


def run_sweep(
    path: str | Path, overrides: Sequence[str] = (), out: str | Path | None = None
) -> str:
    """Run a sweep on Ray Tune and return the printed report (see the module doc).

    Joins the Ray that is already initialized, else `engine.address` of the base experiment, else
    starts a private local Ray (shut down at the end).

    Raises:
        ConfigError: The sweep file is invalid.
        UserError: A trial cannot fit the local Ray, `out` holds another sweep, or every trial failed.
    """
    return sweep_and_report(path, overrides, out)[1]


def sweep_and_report(
    path: str | Path, overrides: Sequence[str] = (), out: str | Path | None = None
) -> tuple[SweepResult, str]:
    """`run_sweep`, also returning the structured result."""
    import ray

    from rayfl.engine.executor import init_ray

    sweep = load_sweep(path, overrides)
    out_dir = Path(out if out is not None else default_out(sweep)).expanduser().resolve()
    e = sweep.config.engine
    started = init_ray(e.address, e.ray_num_cpus)
    try:
        result = _run(sweep, out_dir, strict_fit=started and not e.address)
    finally:
        if started:
            ray.shutdown()
    return result, format_results(result)


def tune_storage(t: TuneSettings, out: Path) -> str:
    """Tune's `RunConfig(storage_path=...)`: `tune.storage` (a path or a URI such as
    s3://bucket/prefix, which outlives the cluster's nodes), else `<out>/tune`."""
    return t.storage or str(out / "tune")


def _run(sweep: Sweep, out: Path, strict_fit: bool) -> SweepResult:
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search import BasicVariantGenerator

    t = sweep.tune
    storage = tune_storage(t, out)
    exp_dir = f"{storage.rstrip('/')}/{sweep.name}"
    state_path = out / "sweep.json"
    restoring = tune.Tuner.can_restore(str(exp_dir))
    state: dict[str, Any] = json.loads(state_path.read_text()) if state_path.exists() else {}
    if restoring and not t.resume:
        raise UserError(
            f"{exp_dir} already holds sweep {sweep.name}; pass tune.resume=true to continue it or choose another --out"
        )
    fingerprint = json.loads(json.dumps(sweep.fingerprint(), default=str))
    if restoring and state.get("fingerprint") not in (None, fingerprint):
        raise UserError(
            f"{out} holds sweep {sweep.name} with another space, base or settings; resume it unchanged or choose another --out"
        )
    _check_fits(sweep, strict=strict_fit)
    out.mkdir(parents=True, exist_ok=True)

    parent: ParentRun | None = None
    uri: str | None = None
    if sweep.config.tracking.backend == "mlflow":
        uri = _absolute_uri(sweep.config.tracking.uri)
        _warn_sqlite_on_cluster(uri)
        # Created here, once: trials creating a fresh SQLite store at once crash in its migration.
        parent = ParentRun(sweep, uri, state.get("parent_run_id") if restoring else None)
    state = {"fingerprint": fingerprint, "parent_run_id": parent.run_id if parent else None}
    state_path.write_text(json.dumps(state, indent=2))
    (out / "sweep.yaml").write_text(yaml.safe_dump(fingerprint, sort_keys=False))

    root = sweep.config.data.root
    job = TrialJob(
        sweep=sweep,
        out=out,
        tracking_uri=uri,
        parent_run_id=parent.run_id if parent else None,
        data_root=str(Path(root).expanduser().resolve()) if root else None,
    )
    trainable = tune.with_resources(
        tune.with_parameters(_trainable, job=job),
        resources=_ResourcesFor(sweep),
    )
    started = time.perf_counter()
    status = "FAILED"
    try:
        if restoring:
            log.info("resuming sweep %s from %s", sweep.name, exp_dir)
            tuner = tune.Tuner.restore(
                str(exp_dir), trainable, resume_unfinished=True, resume_errored=True
            )
        else:
            scheduler = None
            if t.scheduler == "asha":
                scheduler = ASHAScheduler(
                    time_attr="round",
                    max_t=_max_rounds(sweep),
                    grace_period=t.grace_period,
                    reduction_factor=t.reduction_factor,
                )
            tuner = tune.Tuner(
                trainable,
                param_space=search_space(sweep.space),
                tune_config=tune.TuneConfig(
                    metric=t.metric,
                    mode=t.mode,
                    num_samples=t.num_samples,
                    scheduler=scheduler,
                    # The generator's own limit: Tune ignores max_concurrent_trials next to it.
                    search_alg=BasicVariantGenerator(
                        max_concurrent=t.max_concurrent, random_state=t.seed
                    ),
                    trial_name_creator=_trial_name,
                    trial_dirname_creator=_trial_name,
                ),
                run_config=tune.RunConfig(name=sweep.name, storage_path=storage, verbose=t.verbose),
            )
        grid = tuner.fit()
        result = SweepResult(sweep, out, rows=_collect(grid, sweep))
        result.wall_s = time.perf_counter() - started
        result.parent_run_id = parent.run_id if parent else None
        result.tracking_uri = uri
        result.best = _best(result.rows, t.metric, t.mode)
        if not result.rows:
            raise UserError(f"sweep {sweep.name} ran no trials; check space and tune.num_samples")
        write_results(result.rows, out / "results.parquet")
        if result.best is None:
            first = next(
                (r["error"] for r in result.rows if r["error"]), "no trial reported the metric"
            )
            raise UserError(
                f"sweep {sweep.name}: every trial failed ({first}); trial logs are under {exp_dir}"
            )
        result.best_config_path = write_best_config(result)
        artifacts = [out / "results.parquet", result.best_config_path, out / "sweep.yaml"]
        artifacts.append(_plot(result))
        if parent is not None:
            parent.log_artifacts(artifacts)
            parent.log_metrics(
                {f"best/{t.metric}": result.best[t.metric], "trials": len(result.rows)}
            )
        status = "FINISHED"
        return result
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        if parent is not None:
            parent.close(status)


class _ResourcesFor:
    """Picklable `config -> PlacementGroupFactory` (Tune stores it with the experiment)."""

    def __init__(self, sweep: Sweep) -> None:
        self.sweep = sweep

    def __call__(self, config: dict[str, Any]) -> Any:
        return _trial_resources(self.sweep, config)


def _max_rounds(sweep: Sweep) -> int:
    spec = sweep.space.get("engine.rounds")
    if spec is None:
        return sweep.config.engine.rounds
    return int(max(_probe_values(spec)))


def _plot(result: SweepResult) -> Path:
    from rayfl.tracking.plots import plot_metric_vs_params

    return plot_metric_vs_params(
        [r for r in result.rows if r["status"] != "error"],
        result.sweep.tune.metric,
        list(result.sweep.space),
        result.out / "metric_vs_params.png",
    )


def _warn_sqlite_on_cluster(uri: str) -> None:
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if uri.startswith("sqlite:") and len(nodes) > 1:
        log.warning(
            "tracking.uri %s is a SQLite file but the cluster has %d nodes: trials on other nodes write "
            "to their own copy; run an MLflow server and set tracking.uri=http://<head>:5000",
            uri,
            len(nodes),
        )
