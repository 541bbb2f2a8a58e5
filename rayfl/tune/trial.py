"""Tune trials: one trial's experiment, its placement-group bundles and Tune's function trainable
that runs one simulation and reports every evaluated round; and a fixed grid of runs (a suite's
runs `parallel` at a time), one trial per run, each in a placement group sized like a sweep's
trial within its share of the cluster, so runs never hold half of what they need and a run's
numbers do not depend on how many run at once. A grid's resuming is the runs' own (run folders
and checkpoints), so its Tune state lives in a temporary folder and is never restored."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayfl.engine.callbacks import Callback
from rayfl.errors import ConfigError, UserError, suggest
from rayfl.schema import RunConfig
from rayfl.tracking.base import absolute_uri
from rayfl.tune.sweep import Sweep

log = logging.getLogger(__name__)


def trial_shapes(cfg: RunConfig, room: Mapping[str, float] | None = None) -> list[Any]:
    """The reservation (`Resources`) of each worker of one trial: `engine.num_workers` workers,
    else one (one per resource shape with `engine.resources_by_arch`), so a trial never asks
    for the whole cluster; given `room` (a suite run's share of the cluster), as many as a
    round's clients use (or `engine.num_workers`), at most what fits in it."""
    import math

    from rayfl.engine.pool import run_shapes
    from rayfl.schema import clients_per_round

    e, w = cfg.engine, cfg.engine.worker_resources
    if e.resources_by_arch:
        return run_shapes(cfg, room or {"CPU": math.inf, "GPU": math.inf}, one_each=room is None)
    if room is None:
        return [w] * (e.num_workers or 1)
    wanted = e.num_workers or math.ceil(clients_per_round(cfg) / e.clients_per_call)
    needs = (("CPU", w.num_cpus), ("GPU", w.num_gpus))
    fits = [math.floor(room.get(k, 0.0) / n + 1e-9) for k, n in needs if n > 0]
    return [w] * max(1, min([wanted, *fits]))


def trial_bundles(
    cfg: RunConfig, trial_cpus: float, room: Mapping[str, float] | None = None
) -> list[dict[str, float]]:
    """The placement-group bundles one trial (a sweep's trial, a suite's run) reserves: with
    `engine.executor=serial` one worker's resources (the trial trains every client itself); with
    `ray`, `trial_cpus` for its own (mostly waiting) process, one bundle per worker actor
    (`trial_shapes`) and one for the server actor when that asks for resources, so concurrent
    trials never oversubscribe. E.g. `[{'CPU': 0.5}, {'CPU': 1.0}, {'CPU': 1.0}]`."""
    from rayfl.engine.pool import bundle

    e = cfg.engine
    if e.executor == "serial":
        return [bundle(e.worker_resources)]
    bundles = [{"CPU": float(trial_cpus)}]
    bundles += [bundle(r) for r in trial_shapes(cfg, room)]
    server = bundle(e.server_resources)
    return bundles + [server] if server else bundles


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


class TuneReport(Callback):
    """Reports every evaluated round's metrics to Tune (ASHA stops trials by `round`). Rounds
    without the ranking metric (engine.eval_every > 1) are not reported: Tune refuses results
    without it. Missing at the last round means a wrong `tune.metric`: that is an error."""

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
        extra["engine.num_workers"] = len(trial_shapes(cfg))
    return job.sweep.config_for({**values, **extra})


def _trainable(config: dict[str, Any], job: TrialJob) -> None:
    """Tune's function trainable: one simulation (continued, or replayed when it finished,
    after a restore), reporting after every evaluated round."""
    from ray import tune

    from rayfl import gate

    name = tune.get_context().get_trial_name()
    cfg = trial_config(job, config, name)
    with gate.Folder(job.out).sub(f"trials/{name}", create=True) as folder:  # no link on the way
        run_dir = folder.path
    if not replay(run_dir, job.sweep.tune.metric, tune.report):
        continue_run(cfg, run_dir, job.parent_run_id, [TuneReport(job.sweep.tune.metric)])


def continue_run(
    cfg: RunConfig, run_dir: Path, parent_run_id: str | None, callbacks: Sequence[Any] = ()
) -> Any:
    """Run `cfg` in `run_dir` (a sweep's trial, a suite's run), or continue it there: from its
    checkpoint when it has one, else from round 1, replacing what an earlier attempt left (its
    MLflow run deleted, only in the store `cfg` names, so the parent keeps one child per run)."""
    from rayfl import gate
    from rayfl.engine.checkpoint import has_checkpoint
    from rayfl.engine.rundir import MLFLOW_RUN, check_mlflow_ref
    from rayfl.launch import simulate

    resume = has_checkpoint(run_dir)
    if not resume:
        try:
            ref = check_mlflow_ref(run_dir, cfg)
        except UserError:  # recorded in another store: left alone
            ref = None
        if ref is not None:
            from rayfl.tracking.mlflow import delete_run

            delete_run(ref["run_id"], ref.get("tracking_uri") or None)
        with gate.Folder(run_dir) as folder:
            folder.remove(MLFLOW_RUN)
    return simulate(
        cfg,
        run_dir,
        progress=False,
        resume=resume,
        parent_run_id=parent_run_id,
        extra_callbacks=callbacks,
        existing="replace",
    )


def finished(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """The summary and per-round history of a run that FINISHED in `run_dir` (a suite's
    rerun skips it, a restored sweep replays it), else None."""
    from rayfl.engine.rundir import read_summary
    from rayfl.tables import read_table

    summary = read_summary(run_dir)
    if summary.get("status") != "FINISHED":
        return None
    return summary, read_table(run_dir / "metrics.parquet")


def replay(run_dir: Path, metric: str, report: Callable[[dict[str, Any]], None]) -> bool:
    """Report the evaluated rounds of a run that already FINISHED in `run_dir` (it finished
    after the state a sweep was restored from); False when it did not finish."""
    got = finished(run_dir)
    for row in got[1] if got else []:
        if row.get(metric) is not None:
            report({k: float(v) for k, v in row.items() if isinstance(v, int | float)})
    return got is not None


DRIVER_CPUS = 0.01  # a run's own process (with engine.executor=ray it waits on its workers)
Stopped = None  # what `run_grid` returns for a run Ctrl-C stopped before it ended


def pinned(cfg: RunConfig) -> RunConfig:
    """`cfg` made independent of the working directory (a Tune trial runs in its own): the data
    root and the MLflow store as absolute paths."""
    data = dataclasses.replace(
        cfg.data, root=cfg.data.root and str(Path(cfg.data.root).expanduser().absolute())
    )
    tracking = cfg.tracking
    if tracking.backend == "mlflow":
        tracking = dataclasses.replace(tracking, uri=absolute_uri(tracking.uri))
    return dataclasses.replace(cfg, data=data, tracking=tracking)


def run_grid(
    name: str,
    configs: Mapping[int, RunConfig],
    parallel: int,
    fn: Callable[..., dict[str, Any]],
    on_result: Callable[[int, dict[str, Any]], None] | None = None,
    **params: Any,
) -> dict[int, dict[str, Any] | BaseException | None]:
    """Run `fn(cfg, index, **params)` for every `index -> cfg` of `configs`, `parallel` at a
    time, each as a Tune trial in the placement group of its run; `fn` returns a JSON-able
    dict, handed to `on_result(index, returned)` on this process as the trial ends. Returns per
    index what `fn` returned, the error of a trial that died, or `Stopped`."""
    import ray
    from ray import tune

    total = ray.cluster_resources()
    # a run's share of the cluster, less its own process's bundle (its workers fill the rest)
    room = {k: total.get(k, 0.0) / parallel for k in ("CPU", "GPU")}
    room["CPU"] -= DRIVER_CPUS
    jobs: dict[int, RunConfig] = {}
    bundles: dict[int, list[dict[str, float]]] = {}
    for index, cfg in configs.items():
        if cfg.engine.executor == "ray":  # as many workers as its bundles hold
            engine = dataclasses.replace(cfg.engine, num_workers=len(trial_shapes(cfg, room)))
            cfg = dataclasses.replace(cfg, engine=engine)
        jobs[index] = pinned(cfg)
        bundles[index] = trial_bundles(cfg, DRIVER_CPUS, room)
    storage = tempfile.mkdtemp(prefix="rayfl-grid-")
    # Tune's own notes (a Ctrl-C's "resume with Tuner.restore(...)") name this temporary
    # folder: the runs resume from their own folders instead
    tune_log = logging.getLogger("ray.tune")
    level = tune_log.level
    tune_log.setLevel(logging.ERROR)
    try:
        grid: Any = tune.Tuner(
            tune.with_resources(
                tune.with_parameters(_trial, jobs=jobs, fn=fn, params=params),
                resources=lambda config: tune.PlacementGroupFactory(bundles[config["run"]]),
            ),
            param_space={"run": tune.grid_search(list(jobs))},
            tune_config=tune.TuneConfig(
                max_concurrent_trials=parallel, trial_dirname_creator=_dirname, reuse_actors=True
            ),
            run_config=tune.RunConfig(
                name=name, storage_path=storage, verbose=0, callbacks=[_handing(on_result)]
            ),
        ).fit()
    finally:
        tune_log.setLevel(level)
        shutil.rmtree(storage, ignore_errors=True)
    out: dict[int, dict[str, Any] | BaseException | None] = {}
    for result in grid:  # (a trial that died before it reported has no config: its folder)
        index = int(Path(result.path).name.removeprefix("run"))
        reported = (result.metrics or {}).get("returned")
        out[index] = json.loads(reported) if reported else trial_error(result.error)
    return out


def _dirname(trial: Any) -> str:
    return f"run{trial.config['run']}"


def trial_error(error: BaseException | None) -> BaseException | None:
    """A dead trial's error as one line: the last of Ray's traceback (the run's own error,
    e.g. `ModuleNotFoundError: No module named 'rayfl'` from a worker that cannot import it)."""
    if error is None:
        return None
    text = str(error).strip()
    return RuntimeError(
        f"its Ray Tune trial died: {text.splitlines()[-1] if text else repr(error)}"
    )


def _trial(
    config: dict[str, Any], jobs: dict[int, RunConfig], fn: Callable[..., Any], params: Any
) -> None:
    from ray import tune

    index = config["run"]
    tune.report({"returned": json.dumps(fn(jobs[index], index, **params))})


def _handing(on_result: Callable[[int, dict[str, Any]], None] | None) -> Any:
    """A Tune callback that hands each trial's returned dict to `on_result` as it ends (Tune
    keeps a copy of its callbacks in `tuner.pkl`: the copy does nothing)."""
    from ray.tune import Callback

    class Handing(Callback):  # type: ignore[misc]
        def __init__(self, on_result: Any) -> None:
            self.on_result = on_result

        def __reduce__(self) -> Any:
            return (Handing, (None,))

        def on_trial_result(
            self, iteration: int, trials: Any, trial: Any, result: Any, **info: Any
        ) -> None:
            if self.on_result is not None and "returned" in result:
                self.on_result(int(trial.config["run"]), json.loads(result["returned"]))

    return Handing(on_result)
