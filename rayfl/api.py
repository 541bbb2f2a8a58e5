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
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rayfl import plugins as _plugins
from rayfl.config import build_config, read_yaml
from rayfl.errors import UserError
from rayfl.schema import RunConfig, to_dict
from rayfl.tables import read_table

if TYPE_CHECKING:
    from rayfl.tune import SweepResult


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
    """Keyword overrides as the command line's `key=value` strings, after `strings`.

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


@contextmanager
def _api_call(plugins: Sequence[str]) -> Iterator[None]:
    """Name `plugins` for this process; a UserError that Ray wrapped (raised in an actor or
    task) comes out as itself."""
    try:
        _plugins.add(list(plugins))
        yield
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
    """Run one simulation, like `rayfl run`: `config` is an experiment YAML path, its content
    as a dict, or a `RunConfig`; `out`, `plugins`, `resume` and `force` mean what `--out`,
    `--plugin`, `--resume` (continue the run in `out`) and `--force` mean.

    >>> rayfl.run("experiments/pfedes_fmnist.yaml", engine__rounds=2).final["personal/acc"]  # doctest: +SKIP
    """
    from rayfl.launch import default_run_dir, simulate

    with _api_call(plugins):
        cfg = build_config(_raw(config), overrides_of(overrides, strings))
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
    """Run a comparison suite, like `rayfl compare` (the same `out` again resumes it; default
    `runs/suite-<name>-<time>`). Overrides apply to every run (`engine__rounds=2`), or set the
    suite's own keys (`seeds=[0]`, `algorithms=["local"]`, `parallel=2`)."""
    from rayfl.compare import load_suite, run_suite

    with _api_call(plugins):
        cli = overrides_of(overrides, strings)
        if out is None:
            name = load_suite(path, cli).name
            out = Path("runs") / f"suite-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        folder = Path(out)
        table = run_suite(
            path, cli, out=folder, progress=progress, keep_checkpoints=keep_checkpoints
        )
        return SuiteResult(
            out=folder,
            table=table,
            runs=read_table(folder / "runs.parquet"),
            results=read_table(folder / "results.parquet"),
        )


def sweep(
    path: str | Path,
    *strings: str,
    out: str | Path | None = None,
    plugins: Sequence[str] = (),
    **overrides: Any,
) -> SweepResult:
    """Run a Ray Tune sweep, like `rayfl tune` (default `out`: `runs/sweeps/<sweep>-<time>`).
    `tune__num_samples=4` sets the `tune:` section, any other key the base experiment; a space
    entry is a string: `"space.algorithm.T={grid: [2.0, 4.0]}"`."""
    from rayfl.tune import sweep_and_report

    with _api_call(plugins):
        return sweep_and_report(path, overrides_of(overrides, strings), out)[0]
