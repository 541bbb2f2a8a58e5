"""What a sweep produced: one row per trial, the best trial's config, the text report and plot."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rayfl.gate import write as write_atomic
from rayfl.schema import to_dict
from rayfl.tables import text_table
from rayfl.tune.sweep import TEST_METRIC, Sweep, _native, is_validation_metric


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


def reported(sweep: Sweep) -> list[str]:
    """The metrics of a trial's row: the ranking metric and, when it is measured on validation
    data, the test accuracy of the same round (reported, never ranked on)."""
    metric = sweep.tune.metric
    return [metric, TEST_METRIC] if is_validation_metric(metric) else [metric]


def _collect(grid: Any, sweep: Sweep) -> list[dict[str, Any]]:
    """One row per trial: trial, swept values, metrics (last reported), rounds, status, error."""
    rounds = sweep.config.engine.rounds
    rows = []
    for result in grid:
        metrics = result.metrics or {}
        name = Path(result.path).name if result.path else str(metrics.get("trial_id", "?"))
        row: dict[str, Any] = {"trial": name}
        for key in sweep.space:
            row[key] = _native(result.config.get(key)) if result.config else None
        for metric in reported(sweep):
            value = metrics.get(metric)
            row[metric] = float(value) if value is not None else None
        row["rounds"] = int(metrics.get("round", 0))
        wanted = int(result.config.get("engine.rounds", rounds)) if result.config else rounds
        if result.error is not None:
            text = str(result.error).strip()
            row["status"] = "error"
            row["error"] = text.splitlines()[-1][:300] if text else type(result.error).__name__
        else:
            row["status"] = "done" if row["rounds"] >= wanted else "stopped"
            row["error"] = ""
        rows.append(row)
    rows.sort(key=lambda r: r["trial"])
    return rows


def best_row(rows: list[dict[str, Any]], metric: str, mode: str) -> dict[str, Any] | None:
    """The row with the best finite `metric` (the ranking metric only: no other column of a row
    can change which trial wins), or None."""
    scored = [r for r in rows if r.get("status") != "error" and _finite(r.get(metric))]
    return (max if mode == "max" else min)(scored, key=lambda r: r[metric]) if scored else None


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


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
    # atomic: a symlink planted in the sweep folder is replaced, not written through
    write_atomic(path, (header + yaml.safe_dump(to_dict(cfg), sort_keys=False)).encode())
    return path


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if math.isfinite(value) else str(value)
    return "-" if value is None else str(value)


def format_results(result: SweepResult) -> str:
    """The printed report: a table of trials, the best trial, where the outputs are."""
    sweep, rows = result.sweep, result.rows
    metric = sweep.tune.metric
    cols = ["trial", *sweep.space, *reported(sweep), "rounds", "status"]
    names = [f"{c} (test)" if c == TEST_METRIC and c != metric else c for c in cols]
    counts = {s: sum(r["status"] == s for r in rows) for s in ("done", "stopped", "error")}
    lines = [
        f"sweep {sweep.name}: {len(rows)} trials ({counts['done']} done, {counts['stopped']} stopped early, "
        f"{counts['error']} failed), {metric} ({sweep.tune.mode}), {result.wall_s:.1f} s"
    ]
    lines += text_table(names, [[_fmt(r.get(c)) for c in cols] for r in rows])
    for r in rows:
        if r["status"] == "error":
            lines.append(f"  {r['trial']} failed: {r['error']}")
    if result.best is not None:
        chosen = ", ".join(f"{k}={_fmt(result.best[k])}" for k in sweep.space)
        test = ""
        if metric != TEST_METRIC and result.best.get(TEST_METRIC) is not None:
            test = f"; its test {TEST_METRIC}={result.best[TEST_METRIC]:.4f}"
        where = "validation" if is_validation_metric(metric) else "TEST data"
        lines.append(
            f"best: {result.best['trial']} {metric}={result.best[metric]:.4f} with {chosen} "
            f"(chosen on {where}{test})"
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


def _plot(result: SweepResult) -> Path:
    from rayfl.tracking.plots import plot_metric_vs_params

    return plot_metric_vs_params(
        [r for r in result.rows if r["status"] != "error"],
        result.sweep.tune.metric,
        list(result.sweep.space),
        result.out / "metric_vs_params.png",
    )
