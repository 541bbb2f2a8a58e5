"""Running a sweep: the Tune `Tuner`, resume, outputs; the MLflow parent run of a sweep or suite."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from rayfl import gate
from rayfl.errors import UserError
from rayfl.schema import EngineConfig
from rayfl.tables import write_table
from rayfl.tracking.base import absolute_uri
from rayfl.tune.report import (
    SweepResult,
    _collect,
    _plot,
    best_row,
    format_results,
    reported,
    write_best_config,
)
from rayfl.tune.state import check_tune_state, seal_tune_state, snapshots
from rayfl.tune.sweep import Sweep, _probe_values, load_sweep, search_space
from rayfl.tune.trial import TrialJob, _check_fits, _trainable, trial_bundles

log = logging.getLogger(__name__)


class ParentRun:
    """The MLflow parent run of a sweep or a suite, written through a `Tracker` like
    every run (nothing with `tracking.backend=none`); its runs log child runs under it
    (`mlflow.parentRunId`). Its id is kept in `<out>/mlflow_run.json` (through the gate): with
    `reopen` the one recorded there is reopened, not duplicated, only in the store the config
    names, and the children a killed attempt left RUNNING end KILLED. A new one logs `params`.
    """

    def __init__(
        self,
        out: Path,
        tracking: Any,
        name: str,
        tags: Mapping[str, str],
        params: Mapping[str, Any],
        reopen: bool = True,
    ) -> None:
        from rayfl.engine.rundir import read_mlflow_run, write_mlflow_run
        from rayfl.tracking import make_tracker

        mlflow = tracking.backend == "mlflow"
        self.uri = absolute_uri(tracking.uri) if mlflow else None
        previous = read_mlflow_run(out) if mlflow and reopen else None
        if previous is not None and previous.get("tracking_uri") != self.uri:
            previous = None
        self.tracker = make_tracker(
            tracking.backend,
            experiment=tracking.experiment,
            run_name=name,
            tracking_uri=self.uri,
            tags=dict(tags),
            run_id=previous["run_id"] if previous else None,
        )
        self.run_id: str | None = getattr(self.tracker, "run_id", None) or None
        if self.run_id is not None and previous and previous["run_id"] == self.run_id:
            self._end_children()
        else:
            self.tracker.log_config(dict(params))
        if self.run_id is not None and self.uri is not None:
            write_mlflow_run(out, self.run_id, self.uri)

    def _end_children(self) -> None:
        from rayfl.tracking.mlflow import end_child_runs

        if self.run_id is not None:
            end_child_runs(self.run_id, self.uri, "KILLED")

    def log_artifacts(self, paths: Sequence[Path]) -> None:
        for path in paths:
            self.tracker.log_artifact(path)

    def log_metrics(self, metrics: Mapping[str, float]) -> None:
        self.tracker.log_metrics(metrics, step=0)

    def close(self, status: str) -> None:
        """End it with `status`; children still RUNNING (trials Tune stopped or lost, runs an
        interruption stopped) end KILLED."""
        self._end_children()
        self.tracker.close(status)


@contextlib.contextmanager
def held(out: Path) -> Iterator[None]:
    """The folder of a suite or a sweep, held by this process: another `rayfl compare` or
    `rayfl tune` on it is refused in one line."""
    lock = gate.Folder(out, create=True)
    if not lock.lock():
        raise UserError(
            f"{out} is in use by another rayfl compare or tune (pid {lock.owner()}); "
            "wait for it to finish or choose another --out"
        )
    try:
        yield
    finally:
        lock.unlock()
        lock.close()


@contextlib.contextmanager
def ray_for(engine: EngineConfig) -> Iterator[None]:
    """Ray for many runs: the one already initialized, else `engine.address`, else a private
    local Ray shut down at the end."""
    import ray

    from rayfl.engine.startup import init_ray

    started = init_ray(engine.address, engine.ray_num_cpus)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def run_sweep(
    path: str | Path, overrides: Sequence[str] = (), out: str | Path | None = None
) -> str:
    """Run a sweep on Ray Tune and return the printed report (see the module doc). Joins the
    Ray already initialized, else `engine.address` of the base experiment, else starts a private
    local Ray (shut down at the end). A UserError when a trial cannot fit the local Ray, `out`
    holds another sweep, or every trial failed."""
    return sweep_and_report(path, overrides, out)[1]


def sweep_and_report(
    path: str | Path, overrides: Sequence[str] = (), out: str | Path | None = None
) -> tuple[SweepResult, str]:
    """`run_sweep`, also returning the structured result."""
    import ray

    sweep = load_sweep(path, overrides)
    default = Path("runs") / "sweeps" / f"{sweep.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir = Path(out if out is not None else default).expanduser().resolve()
    try:  # the fingerprint of an earlier start, read before Ray starts
        state = dict(gate.read_json(out_dir / "sweep.json"))
    except FileNotFoundError:
        state = {}
    check_folder(sweep, out_dir)
    e = sweep.config.engine
    private = not ray.is_initialized() and not e.address
    with held(out_dir), ray_for(e):
        result = _run(sweep, out_dir, state, strict_fit=private)
    return result, format_results(result)


def check_folder(sweep: Sweep, out: Path) -> None:
    """Before Ray starts: `<out>/tune` and `<out>/trials` are real folders made through the gate
    (a planted link is refused), and Tune's state there, if any, is what this user's rayfl
    sealed (`check_tune_state`). A `tune.storage` the user named is theirs to trust."""
    if sweep.tune.storage:
        return
    with gate.Folder(out, create=True) as folder:
        folder.sub("trials", create=True).close()
        with folder.sub("tune", create=True) as tune_dir:
            if sweep.tune.resume and tune_dir.kind(sweep.name) is not None:
                check_tune_state(out, sweep.name)


def _run(sweep: Sweep, out: Path, state: dict[str, Any], strict_fit: bool) -> SweepResult:
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search import BasicVariantGenerator

    t = sweep.tune
    inside = not t.storage  # Tune's storage in the sweep folder: sealed through the gate
    storage = t.storage or str(out / "tune")  # a path, or a URI every node reaches
    exp_dir = f"{storage.rstrip('/')}/{sweep.name}"
    restoring = tune.Tuner.can_restore(str(exp_dir))
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
    if sweep.config.tracking.backend == "mlflow":
        _warn_sqlite_on_cluster(absolute_uri(sweep.config.tracking.uri))
    # Created here, once: trials creating a fresh SQLite store at once crash in its migration.
    parent = ParentRun(
        out,
        sweep.config.tracking,
        sweep.name,
        tags={"rayfl.sweep": sweep.name, "rayfl.base": str(sweep.base)},
        params={
            "space": {k: json.dumps(v) for k, v in sweep.space.items()},
            "tune": dataclasses.asdict(sweep.tune),
            "base": str(sweep.base),
            "overrides": " ".join(sweep.overrides),
        },
        reopen=restoring,
    )
    gate.write(out / "sweep.json", json.dumps({"fingerprint": fingerprint}, indent=2).encode())
    gate.write(out / "sweep.yaml", yaml.safe_dump(fingerprint, sort_keys=False).encode())

    root = sweep.config.data.root
    job = TrialJob(
        sweep=sweep,
        out=out,
        tracking_uri=parent.uri,
        parent_run_id=parent.run_id,
        data_root=str(Path(root).expanduser().resolve()) if root else None,
    )
    trainable = tune.with_resources(
        tune.with_parameters(_trainable, job=job),
        resources=lambda config: tune.PlacementGroupFactory(
            trial_bundles(sweep.config_for(config), t.trial_cpus)
        ),
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
                rounds = sweep.space.get("engine.rounds")  # swept: its largest value
                scheduler = ASHAScheduler(
                    time_attr="round",
                    max_t=int(max(_probe_values(rounds))) if rounds else sweep.config.engine.rounds,
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
                    reuse_actors=True,  # the next trial of the same bundles reuses the process
                ),
                run_config=tune.RunConfig(
                    name=sweep.name,
                    storage_path=storage,
                    verbose=t.verbose,
                    callbacks=[snapshots()] if inside else None,
                ),
            )
        rows = _collect(tuner.fit(), sweep)
        result = SweepResult(sweep, out, rows, best_row(rows, t.metric, t.mode))
        result.wall_s = time.perf_counter() - started
        result.parent_run_id, result.tracking_uri = parent.run_id, parent.uri
        if not result.rows:
            raise UserError(f"sweep {sweep.name} ran no trials; check space and tune.num_samples")
        write_table(result.rows, out / "results.parquet")  # mixed-type columns as text
        if result.best is None:
            first = next((r["error"] for r in rows if r["error"]), "no trial reported the metric")
            raise UserError(
                f"sweep {sweep.name}: every trial failed ({first}); trial logs are under {exp_dir}"
            )
        result.best_config_path = write_best_config(result)
        parent.log_artifacts(
            [out / "results.parquet", result.best_config_path, out / "sweep.yaml", _plot(result)]
        )
        best = {f"best/{k}": result.best[k] for k in reported(sweep) if result.best[k] is not None}
        parent.log_metrics({**best, "trials": len(result.rows)})
        status = "FINISHED"
        return result
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        if inside:
            try:
                seal_tune_state(out)
            except (OSError, UserError) as exc:  # the sweep's own error, if any, goes on
                log.warning(
                    "Tune's state in %s was not sealed (%s): it cannot be resumed", out, exc
                )
        parent.close(status)


def _trial_name(trial: Any) -> str:
    return f"trial_{trial.trial_id}"


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
