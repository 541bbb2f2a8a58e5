"""The Python API: `rayfl.run`, `rayfl.suite` and `rayfl.sweep`, for notebooks and scripts
(docs/api.md).

Each takes what the matching command takes (`rayfl run | compare | tune`) and goes the same road
(`rayfl.config.build_config` + `rayfl.launch.simulate`, `rayfl.compare.run_suite`,
`rayfl.tune.sweep_and_report`), but returns a result object instead of printing, never exits
the interpreter, and raises `rayfl.errors.UserError` (`ConfigError` for a bad config) with the
CLI's one-line message for anything the caller can fix.

Overrides are keyword arguments, `engine__rounds=2` (a double underscore for each dot) or a
mapping per section, `engine={"rounds": 2}`, or the command line's strings as positional
arguments, `"engine.rounds=2"`; all three mean `engine.rounds=2`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rayfl import plugins as _plugins
from rayfl.config import build_config, read_yaml
from rayfl.errors import UserError
from rayfl.schema import RunConfig, to_dict

if TYPE_CHECKING:
    from rayfl.tune import SweepResult

T = TypeVar("T")


@dataclass(frozen=True)
class RunResult:
    """What one simulation produced (also written to `run_dir`)."""

    final: dict[str, float]  # the last value of every metric (`personal/acc`, `comm/...`)
    history: list[dict[str, float]]  # one row of metrics per round
    run_dir: Path  # config.yaml, metrics.parquet, summary.json, plots, checkpoints
    mlflow_run_id: str | None  # None unless `tracking.backend` is mlflow
    status: str  # FINISHED, or FAILED / KILLED
    config: RunConfig  # the validated config that ran


@dataclass(frozen=True)
class SuiteResult:
    """What a comparison suite produced (also written under `out`)."""

    out: Path  # every run's directory, runs.parquet, results.parquet, plots, table.txt
    table: str  # the comparison table `rayfl compare` prints
    runs: list[dict[str, Any]] = field(default_factory=list)  # one row per run (runs.parquet)
    results: list[dict[str, Any]] = field(default_factory=list)  # mean and std over seeds


def overrides_of(kwargs: Mapping[str, Any], strings: Sequence[str] = ()) -> list[str]:
    """Keyword overrides as the command line's `key=value` strings, after `strings` (already
    in that form).

    >>> overrides_of({"engine__rounds": 2, "train": {"lr": 0.1}, "algorithm__name": "local"})
    ['engine.rounds=2', 'train.lr=0.1', 'algorithm.name="local"']
    """
    out: list[str] = list(strings)

    def walk(key: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(f"{key}.{k}", v)
        else:
            # JSON is YAML: the value parses back exactly (a string stays a string)
            out.append(f"{key}={json.dumps(list(value) if isinstance(value, tuple) else value)}")

    for key, value in kwargs.items():
        walk(key.replace("__", "."), value)
    return out


def _clean_errors(fn: Callable[[], T]) -> T:
    """Run `fn`; a UserError that Ray wrapped (raised in an actor or task) comes out as itself."""
    try:
        return fn()
    except UserError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, UserError):
            raise cause from None
        raise


def run(
    config: str | Path | Mapping[str, Any] | RunConfig,
    *strings: str,
    out: str | Path | None = None,
    plugins: Sequence[str] = (),
    progress: bool = True,
    resume: bool = False,
    force: bool = False,
    **overrides: Any,
) -> RunResult:
    """Run one simulation, like `rayfl run`.

    Args:
        config: an experiment YAML path, the same content as a dict, or a `RunConfig`.
        *strings: overrides as on the command line, e.g. `"engine.rounds=2"`.
        out: the run directory (default `runs/<name>-<algorithm>-s<seed>-<time>`); with
            `resume=True`, the directory of the run to continue.
        plugins: `.py` files or module names registering algorithms, models or datasets
            (`--plugin`; relative to the current directory).
        progress: show the progress bar on stderr.
        resume: continue the run in `out` from its last checkpoint.
        force: `out` holds a run already: move it aside (`<out>.archived-<time>`) first.
        **overrides: config overrides, e.g. `engine__rounds=2` or `engine={"rounds": 2}`.

    Returns:
        The run's final metrics, per-round history, run directory and MLflow run id.

    Raises:
        UserError: a bad config (`ConfigError`), missing data, a run directory in use, ...

    Example:
        >>> import rayfl
        >>> result = rayfl.run("experiments/pfedes_fmnist.yaml", engine__rounds=2)  # doctest: +SKIP
        >>> result.final["personal/acc"]  # doctest: +SKIP
    """
    from rayfl.launch import default_run_dir, simulate

    def go() -> RunResult:
        _plugins.add(list(plugins))
        raw = _raw(config)
        cfg = build_config(raw, overrides_of(overrides, strings))
        if resume and out is None:
            raise UserError("rayfl.run(resume=True) needs out=<the run directory to continue>")
        run_dir = Path(out) if out is not None else default_run_dir(cfg)
        existing = "archive" if force else "refuse"
        result = simulate(cfg, run_dir, progress=progress, resume=resume, existing=existing)
        return RunResult(
            final=dict(result.final),
            history=list(result.history),
            run_dir=run_dir,
            mlflow_run_id=result.tracker_run_id if cfg.tracking.backend == "mlflow" else None,
            status=result.status,
            config=cfg,
        )

    return _clean_errors(go)


def _raw(config: str | Path | Mapping[str, Any] | RunConfig) -> dict[str, Any]:
    if isinstance(config, RunConfig):
        return dict(to_dict(config))
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, str | Path):
        raise UserError(
            f"config: expected a YAML path, a dict or a RunConfig, got {type(config).__name__}"
        )
    return read_yaml(config)


def suite(
    path: str | Path,
    *strings: str,
    out: str | Path | None = None,
    plugins: Sequence[str] = (),
    progress: bool = True,
    keep_checkpoints: bool = False,
    **overrides: Any,
) -> SuiteResult:
    """Run a comparison suite, like `rayfl compare` (the same `out` again resumes it).

    Args:
        path: the suite YAML.
        *strings: overrides as on the command line, e.g. `"seeds=[0]"`.
        out: the output folder (default `runs/suite-<name>-<time>`).
        plugins: see `run`.
        progress: show a progress bar over the runs.
        keep_checkpoints: keep each finished run's checkpoint.
        **overrides: applied to every run (`engine__rounds=2`), plus the suite's selectors
            and settings: `seeds=[0]`, `algorithms=["local"]`, `settings=[...]`, `parallel=2`.

    Returns:
        The output folder, the printed table, one row per run and the per-algorithm results.
    """
    from rayfl.compare import load_suite, run_suite

    def go() -> SuiteResult:
        _plugins.add(list(plugins))
        cli = overrides_of(overrides, strings)
        folder = Path(out) if out is not None else _default_suite_out(path, cli)
        table = run_suite(
            path, cli, out=folder, progress=progress, keep_checkpoints=keep_checkpoints
        )
        return SuiteResult(
            out=folder,
            table=table,
            runs=_rows(folder / "runs.parquet"),
            results=_rows(folder / "results.parquet"),
        )

    def _default_suite_out(path: str | Path, cli: list[str]) -> Path:
        name = load_suite(path, cli).name
        return Path("runs") / f"suite-{name}-{time.strftime('%Y%m%d-%H%M%S')}"

    return _clean_errors(go)


def _rows(path: Path) -> list[dict[str, Any]]:
    from rayfl.tables import read_table

    return read_table(path)


def sweep(
    path: str | Path,
    *strings: str,
    out: str | Path | None = None,
    plugins: Sequence[str] = (),
    **overrides: Any,
) -> SweepResult:
    """Run a Ray Tune sweep, like `rayfl tune`.

    Args:
        path: the sweep YAML.
        *strings: overrides as on the command line, e.g.
            `"space.algorithm.T={grid: [2.0, 4.0]}"` (a space entry is written this way).
        out: the output folder (default `runs/sweeps/<sweep>-<time>`).
        plugins: see `run`.
        **overrides: `tune__num_samples=4` sets the `tune:` section; every other key goes to
            the base experiment (`engine__rounds=2`).

    Returns:
        `rayfl.tune.SweepResult`: one row per trial, the best trial and its config file, the
        MLflow parent run id.
    """
    from rayfl.tune import sweep_and_report

    def go() -> SweepResult:
        _plugins.add(list(plugins))
        return sweep_and_report(path, overrides_of(overrides, strings), out)[0]

    return _clean_errors(go)
