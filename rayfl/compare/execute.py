"""Running a suite: each run (or its resume) in its run directory, `parallel` at a time as a Ray
Tune grid, under one MLflow parent run; then the tables, curves and artifacts."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rayfl import gate
from rayfl.compare.results import (
    ARCH_PREFIX,
    DOMAIN_PREFIX,
    PERSONAL,
    aggregate,
    curves_and_spread,
    failed_row,
    format_results,
    mean_col,
    run_row,
)
from rayfl.compare.suite import Suite, SuiteRun, load_suite
from rayfl.engine.checkpoint import result_settings
from rayfl.engine.rundir import read_mlflow_run
from rayfl.errors import ConfigError, UserError
from rayfl.schema import RunConfig, to_dict
from rayfl.tables import write_table
from rayfl.tune.run import ParentRun, held, ray_for
from rayfl.tune.trial import Stopped, continue_run, finished, pinned, run_grid

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


def run_dir_of(out_dir: Path, run: SuiteRun) -> Path:
    """Where a suite run lives, `[setting/]label/seedN` under `out_dir`, made through the gate
    (a link on the way is refused, never followed)."""
    rel = Path(run.setting or ".") / run.label / f"seed{run.seed}"
    with gate.Folder(out_dir).sub(str(rel), create=True) as folder:
        return folder.path


def finished_row(
    run: SuiteRun, run_dir: Path
) -> tuple[dict[str, Any], list[dict[str, float]]] | None:
    """The row and history of a run that already FINISHED in `run_dir` (a resumed suite skips
    it), or None."""
    got = finished(run_dir)
    if got is None:
        return None
    summary, history = got
    ran = result_settings(summary.get("config") or {})
    now = result_settings(to_dict(pinned(run.config)))
    if ran != now:
        key, was, wanted = first_difference(ran, now)
        raise UserError(
            f"{run_dir} finished with {key}={was!r}, but the suite now gives {wanted!r}: run "
            "into another --out, or delete that run's folder to run it again"
        )
    ref = read_mlflow_run(run_dir)
    wall_s, final = float(summary.get("wall_s", 0.0)), summary.get("final", {})
    run_id = ref["run_id"] if ref else None
    return run_row(run, run_dir, wall_s, "FINISHED", final, len(history), run_id), history


def first_difference(a: Any, b: Any, key: str = "") -> tuple[str, Any, Any]:
    """The first dotted key where nested mappings `a` and `b` differ, with a's and b's values
    there (a value missing from one side is None)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return first_difference(a.get(k), b.get(k), f"{key}.{k}" if key else k)
    return key, a, b


def remove_checkpoints(run_dir: Path) -> None:
    """Delete a finished run's checkpoint: the `checkpoint` link and the folders it points into."""
    with gate.Folder(run_dir) as folder:
        for name in folder.names():
            if name == "checkpoint" or name.startswith("checkpoint."):
                folder.remove(name)


def execute_run(
    run: SuiteRun, run_dir: Path, parent_id: str | None, keep_checkpoints: bool
) -> tuple[dict[str, Any], list[dict[str, float]]]:
    """Run (or resume from its checkpoint) one suite run; a failure becomes a FAILED row with
    the error instead of ending the suite. Checkpoints go once it finished, unless kept."""
    start = time.perf_counter()
    try:
        result = continue_run(run.config, run_dir, parent_id)
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        log.warning("suite run %s failed: %s", run_dir, exc)
        return failed_row(run, run_dir, exc, time.perf_counter() - start), []
    wall_s, rounds = time.perf_counter() - start, len(result.history)
    row = run_row(run, run_dir, wall_s, result.status, result.final, rounds, result.tracker_run_id)
    if result.status == "FINISHED" and not keep_checkpoints:
        remove_checkpoints(run_dir)
    return row, result.history


def _execute(
    suite: Suite,
    todo: list[tuple[int, SuiteRun, Path]],
    parent_id: str | None,
    keep_checkpoints: bool,
    done: Any,
) -> None:
    """Run `todo` `suite.parallel` at a time as a Ray Tune grid (`rayfl.tune.trial.run_grid`);
    `done(index, row, history)` as each run ends. Raises KeyboardInterrupt when Ctrl-C stopped
    a run before it ended."""
    runs = {index: (run, run_dir) for index, run, run_dir in todo}

    def ended(index: int, got: dict[str, Any]) -> None:
        done(index, {**got["row"], "run_dir": str(runs[index][1])}, got["history"])

    results = run_grid(
        suite.name,
        {index: run.config for index, run, _ in todo},
        suite.parallel,
        _grid_run,
        on_result=ended,
        runs={index: (run, str(run_dir.absolute())) for index, run, run_dir in todo},
        parent_id=parent_id,
        keep_checkpoints=keep_checkpoints,
    )
    stopped = False
    for index, run, run_dir in todo:
        got = results.get(index, Stopped)
        if got is Stopped:  # Ctrl-C stopped it before it ended
            stopped = True
        elif not isinstance(got, dict):  # the trial itself died (not the run's own error)
            log.warning("suite run %s failed: %s", run_dir, got)
            done(index, failed_row(run, run_dir, got), [])
    if stopped:
        raise KeyboardInterrupt


def _grid_run(
    cfg: RunConfig, index: int, runs: dict[int, tuple[SuiteRun, str]], **kw: Any
) -> dict[str, Any]:
    """One suite run as a grid trial: its row and history (handed to `ended` as it ends)."""
    run, run_dir = runs[index]
    row, history = execute_run(run._replace(config=cfg), Path(run_dir), **kw)
    return {"row": row, "history": history}


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
    """Run every run of a suite (see the package doc) into `out` (default
    `runs/suite-<name>-<time>`) and return the comparison table (also `<out>/table.txt`).

    Joins the Ray already initialized, else `engine.address` of the first run, else starts a
    private local Ray (shut down at the end). An interrupted suite ends its parent and unfinished
    children KILLED; a run that restarts from round 1 (no checkpoint) replaces its partial
    MLflow run. `keep_checkpoints` keeps each finished run's checkpoint.

    Raises:
        SuiteInterrupted: Ctrl-C or SIGTERM; finished runs and checkpoints are kept in `out`.
        UserError: another `rayfl compare` is running in `out`.
    """
    suite = load_suite(path, overrides)
    preflight(suite)
    out_dir = (
        Path(out) if out else Path("runs") / f"suite-{suite.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    try:
        with held(out_dir):
            return _run_held(suite, Path(path), overrides, out_dir, progress, keep_checkpoints)
    except KeyboardInterrupt:
        raise SuiteInterrupted(out_dir) from None


def _run_held(
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
    first = suite.runs[0].config.tracking
    params: dict[str, Any] = {"suite": suite.name, "file": str(path), "seeds": suite.seeds}
    params |= {"labels": suite.labels, "algorithms": suite.algorithms, "settings": suite.settings}
    params |= {"overrides": list(overrides), "runs": len(suite.runs), "parallel": suite.parallel}
    # (this process holds the folder's lock: children a reopened parent left RUNNING were killed)
    parent = ParentRun(out_dir, first, f"suite-{suite.name}", {"rayfl.suite": suite.name}, params)
    slots: list[tuple[dict[str, Any], list[Any]] | None] = [None] * len(suite.runs)
    todo: list[tuple[int, SuiteRun, Path]] = []
    for index, run in enumerate(suite.runs):
        run_dir = run_dir_of(out_dir, run)
        slots[index] = finished_row(run, run_dir)
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

    try:  # a Ray that cannot start ends the parent run FAILED, not RUNNING
        if todo:
            with ray_for(suite.runs[0].config.engine):
                _execute(suite, todo, parent.run_id, keep_checkpoints, done)
    except BaseException as exc:
        parent.close("KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
        raise
    finally:
        bar.close()

    rows = [s[0] for s in slots if s is not None]
    histories: dict[str, dict[str, list[Any]]] = defaultdict(lambda: defaultdict(list))
    for run, slot in zip(suite.runs, slots):
        if slot is not None and slot[1]:
            histories[run.setting][run.label].append(slot[1])
    results = aggregate(rows)
    artifacts = write_table(rows, out_dir / "runs", csv=True)
    artifacts += write_table(results, out_dir / "results", csv=True)
    for setting, by_label in histories.items():
        means, spread = curves_and_spread(by_label, PERSONAL)
        name = f"curves_personal_acc{'_' + setting if setting else ''}.png"
        artifacts.append(plot_compare(means, out_dir / name, ylabel=PERSONAL, spread=spread))
    failed = [r for r in rows if r["status"] != "FINISHED"]
    table = format_results(suite, results, time.perf_counter() - start, failed)
    gate.write(out_dir / "table.txt", (table + "\n").encode())
    artifacts.append(out_dir / "table.txt")
    suffix = mean_col("")  # the mean accuracies, as `[setting/]label/<metric>`
    parent.log_metrics(
        {
            f"{a['setting'] + '/' if a['setting'] else ''}{a['label']}/{k[: -len(suffix)]}": v
            for a in results
            for k, v in a.items()
            if k.endswith(suffix)
            and v is not None
            and (k.endswith(mean_col("/acc")) or k.startswith((ARCH_PREFIX, DOMAIN_PREFIX)))
        }
    )
    parent.log_artifacts(artifacts)
    parent.close("FAILED" if failed else "FINISHED")
    log.info("suite %s written to %s", suite.name, out_dir)
    return table + f"\nresults: {out_dir}"
