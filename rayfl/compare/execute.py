"""Running a suite: each run (or its resume) in its run directory, one after another or as Ray
tasks in placement groups, under one MLflow parent run; then the tables, curves and artifacts."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rayfl import gate
from rayfl.compare.results import (
    ARCH_PREFIX,
    DOMAIN_PREFIX,
    PERSONAL,
    _final_row,
    aggregate,
    curves_and_spread,
    format_results,
    mean_col,
)
from rayfl.compare.suite import Suite, SuiteRun, load_suite, run_name
from rayfl.engine.rundir import MLFLOW_RUN, read_mlflow_run, write_mlflow_run
from rayfl.errors import ConfigError, UserError
from rayfl.schema import RunConfig
from rayfl.tables import read_table, write_table

log = logging.getLogger(__name__)


def preflight(suite: Suite) -> None:
    """Checks that need the dataset's shape (feature sizes), before hours of runs start."""
    from rayfl.algorithms import ALGORITHMS
    from rayfl.data.datasets import load_dataset
    from rayfl.models.families import family_from_config

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


def run_dir_of(out_dir: Path, run: SuiteRun, create: bool = False) -> Path:
    """Where a suite run lives, `[setting/]label/seedN` under `out_dir`; with `create`, made
    through the gate (a link on the way is refused, never followed)."""
    rel = Path(run.setting or ".") / run.label / f"seed{run.seed}"
    if create:
        with gate.Folder(out_dir).sub(str(rel), create=True) as folder:
            return folder.path
    return out_dir / rel


def _read_history(run_dir: Path) -> list[dict[str, float]]:
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
    ref = read_mlflow_run(run_dir)
    result = SimpleNamespace(
        final=summary.get("final", {}),
        history=history,
        status="FINISHED",
        tracker_run_id=ref["run_id"] if ref else None,
    )
    return _final_row(run, result, float(summary.get("wall_s", 0.0)), run_dir), history


def remove_checkpoints(run_dir: Path) -> None:
    """Delete a finished run's checkpoint: the `checkpoint` link and the folders it points into."""
    with gate.Folder(run_dir) as folder:
        for name in folder.names():
            if name == "checkpoint" or name.startswith("checkpoint."):
                folder.remove(name)


def discard_partial_child(run_dir: Path, cfg: RunConfig) -> None:
    """Before a run starts again from round 1 (its earlier attempt left no checkpoint): delete the
    MLflow run that attempt opened (only in the store the run's config names), so that the
    suite's parent keeps one child per run."""
    from rayfl.engine.rundir import check_mlflow_ref

    try:
        ref = check_mlflow_ref(run_dir, cfg)
    except UserError:  # recorded in another store: left alone
        ref = None
    if ref is not None:
        from rayfl.tracking.mlflow import delete_run

        delete_run(ref["run_id"], ref.get("tracking_uri") or None)
    with gate.Folder(run_dir) as folder:
        folder.remove(MLFLOW_RUN)


def execute_run(
    run: SuiteRun, run_dir: Path, parent_id: str | None, keep_checkpoints: bool
) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """Run (or resume from its checkpoint) one suite run; a failure becomes a FAILED row with
    the error instead of ending the suite. Checkpoints go once it finished, unless kept."""
    from rayfl.launch import simulate

    resume = (run_dir / "checkpoint").exists()
    if not resume:
        discard_partial_child(run_dir, run.config)
    start = time.perf_counter()
    try:
        result = simulate(
            run.config,
            run_dir,
            progress=False,
            resume=resume,
            parent_run_id=parent_id,
            existing="replace",
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
    from rayfl.schema import clients_per_round

    e = cfg.engine
    w = e.worker_resources
    if e.executor == "serial":
        return [{"CPU": max(w.num_cpus, 1.0)}], cfg
    import ray

    total = ray.cluster_resources()
    driver = {"CPU": 0.01 + e.server_resources.num_cpus}
    if e.server_resources.num_gpus > 0:
        driver["GPU"] = e.server_resources.num_gpus
    if e.resources_by_arch:  # a pool per shape, sized within the run's share
        from rayfl.engine.pool import bundle, run_shapes

        share_of = {k: total.get(k, 0.0) * share for k in ("CPU", "GPU")}
        shapes = run_shapes(cfg, share_of)
        cfg = dataclasses.replace(cfg, engine=dataclasses.replace(e, num_workers=len(shapes)))
        return [driver, *(bundle(r) for r in shapes)], cfg
    room = []
    if w.num_cpus > 0:
        room.append(math.floor(total.get("CPU", 0.0) * share / w.num_cpus + 1e-9))
    if w.num_gpus > 0:
        room.append(math.floor(total.get("GPU", 0.0) * share / w.num_gpus + 1e-9))
    wanted = e.num_workers or math.ceil(clients_per_round(cfg) / e.clients_per_call)
    workers = max(1, min(wanted, *room))
    worker = {k: v for k, v in (("CPU", w.num_cpus), ("GPU", w.num_gpus)) if v > 0}
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(e, num_workers=workers))
    return [driver] + [dict(worker) for _ in range(workers)], cfg


def driver_share(cfg: RunConfig, bundle: dict[str, float]) -> dict[str, float]:
    """What a suite run's driver task reserves of its bundle 0: all of it, unless the run's
    server is an actor, which then takes the bundle's server part (the driver keeps a sliver)."""
    from rayfl.schema import server_in_driver

    if cfg.engine.executor == "serial" or server_in_driver(cfg.engine):
        return bundle
    return {"CPU": 0.01}


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
            own = driver_share(cfg, bundles[0])
            ref = remote.options(
                num_cpus=own.get("CPU", 0.0),
                num_gpus=own.get("GPU", 0.0),
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


class SuiteInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) during a suite: `out_dir` is the folder that the same command with
    `--out out_dir` resumes."""

    def __init__(self, out_dir: Path) -> None:
        super().__init__(str(out_dir))
        self.out_dir = out_dir


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
    `summary.json` are skipped, unfinished ones continue from their checkpoints, each in its own
    MLflow run, and all under the parent run of the first attempt (its id is kept in
    `<out>/mlflow_run.json`). An interrupted suite ends its parent and its unfinished children
    KILLED; a run that restarts from round 1 (it left no checkpoint) replaces its partial MLflow
    run. A run that fails is recorded (status FAILED, its error) and the suite goes on.

    Args:
        path: the suite YAML.
        overrides: see `load_suite`.
        out: output folder (default `runs/suite-<name>-<time>`).
        progress: show a progress bar over the runs on stderr.
        keep_checkpoints: keep each finished run's checkpoint (default: removed once it finished).

    Returns:
        The comparison table (also written to `<out>/table.txt`).

    Raises:
        SuiteInterrupted: Ctrl-C or SIGTERM; finished runs and checkpoints are kept in `out`.
        UserError: another `rayfl compare` is running in `out`.
    """
    suite = load_suite(path, overrides)
    preflight(suite)
    out_dir = (
        Path(out) if out else Path("runs") / f"suite-{suite.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    lock = gate.Folder(out_dir, create=True)
    if not lock.lock():
        raise UserError(
            f"suite folder {out_dir} is in use by another rayfl compare (pid {lock.owner()}); "
            "wait for it to finish or choose another --out"
        )
    try:
        return _run_locked(suite, Path(path), overrides, out_dir, progress, keep_checkpoints)
    except KeyboardInterrupt:
        raise SuiteInterrupted(out_dir) from None
    finally:
        lock.unlock()
        lock.close()


def _parent_tracker(suite: Suite, path: Path, overrides: Sequence[str], out_dir: Path) -> Any:
    """The suite's MLflow parent run: the one recorded in `out_dir` (a resume), else a new one,
    recorded there. Children left RUNNING by a killed earlier attempt end KILLED (this process
    holds the folder's lock, so none of them is still running)."""
    from rayfl.tracking import make_tracker

    first = suite.runs[0].config.tracking
    mlflow = first.backend == "mlflow"
    previous = read_mlflow_run(out_dir) if mlflow else None
    if previous is not None:  # reopened only in the store this suite's config names
        from rayfl.tracking.base import default_tracking_uri

        if previous.get("tracking_uri") != (first.uri or default_tracking_uri()):
            previous = None
    parent = make_tracker(
        first.backend,
        experiment=first.experiment,
        run_name=f"suite-{suite.name}",
        tracking_uri=first.uri,
        tags={"rayfl.suite": suite.name},
        run_id=previous["run_id"] if previous else None,
    )
    parent_id = getattr(parent, "run_id", None)
    if mlflow and parent_id:
        uri = getattr(parent, "tracking_uri", "") or ""
        write_mlflow_run(out_dir, parent_id, uri)
        if previous is not None and previous["run_id"] == parent_id:
            from rayfl.tracking.mlflow import end_child_runs

            end_child_runs(parent_id, uri or None, "KILLED")
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
    return parent


def _end_parent(parent: Any, status: str) -> None:
    """End the parent run and any child still RUNNING (a parallel run's task that was stopped
    never closes its own run) with `status`."""
    parent_id = getattr(parent, "run_id", None)
    if parent_id and hasattr(parent, "tracking_uri"):
        from rayfl.tracking.mlflow import end_child_runs

        end_child_runs(parent_id, parent.tracking_uri, status)
    parent.close(status)


def _run_locked(
    suite: Suite,
    path: Path,
    overrides: Sequence[str],
    out_dir: Path,
    progress: bool,
    keep_checkpoints: bool,
) -> str:
    from tqdm.auto import tqdm

    from rayfl.tracking.plots import plot_compare

    gate.write(out_dir / "suite.yaml", path.read_bytes())
    previous = {r["run_dir"]: r for r in read_table(out_dir / "runs.parquet")}
    parent = _parent_tracker(suite, path, overrides, out_dir)
    parent_id = getattr(parent, "run_id", None)
    slots: list[tuple[dict[str, Any], list[Any]] | None] = [None] * len(suite.runs)
    todo: list[tuple[int, SuiteRun, Path]] = []
    for index, run in enumerate(suite.runs):
        run_dir = run_dir_of(out_dir, run, create=True)
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
        _end_parent(parent, "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
        raise
    finally:
        bar.close()
        if started_ray:
            import ray

            ray.shutdown()

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
        means, spread = curves_and_spread(by_label, PERSONAL)
        name = f"curves_personal_acc{'_' + setting if setting else ''}.png"
        artifacts.append(plot_compare(means, out_dir / name, ylabel=PERSONAL, spread=spread))
    failed = [r for r in rows if r["status"] != "FINISHED"]
    table = format_results(suite, results, time.perf_counter() - start, failed)
    gate.write(out_dir / "table.txt", (table + "\n").encode())
    artifacts.append(out_dir / "table.txt")
    for agg in results:
        prefix = f"{agg['setting'] + '/' if agg['setting'] else ''}{agg['label']}/"
        suffix = mean_col("")
        accs = {
            prefix + k[: -len(suffix)]: v
            for k, v in agg.items()
            if k.endswith(suffix)
            and v is not None
            and (k.endswith(mean_col("/acc")) or k.startswith((ARCH_PREFIX, DOMAIN_PREFIX)))
        }
        parent.log_metrics(accs, step=0)
    for artifact in artifacts:
        parent.log_artifact(artifact)
    parent.close("FAILED" if failed else "FINISHED")
    log.info("suite %s written to %s", suite.name, out_dir)
    return table + f"\nresults: {out_dir}"
