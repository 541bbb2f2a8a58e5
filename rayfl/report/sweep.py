"""The report of a sweep folder (`rayfl tune`: `results.parquet`, `sweep.yaml`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

from rayfl import gate
from rayfl.errors import UserError
from rayfl.report.page import MAX_DRAWN, esc, figure, is_file, page, read_history, run_links, table
from rayfl.tables import read_table


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def sweep_report(out_dir: Path) -> str:
    from rayfl.config import parse_yaml
    from rayfl.tracking.plots import plot_compare, plot_metric_vs_params
    from rayfl.tune.report import best_row
    from rayfl.tune.sweep import TEST_METRIC, is_validation_metric

    rows = read_table(out_dir / "results.parquet")
    raw = parse_yaml(gate.read_text(out_dir / "sweep.yaml"), out_dir / "sweep.yaml")
    space = raw.get("space") or {}
    tune = raw.get("tune") or {}
    metric = str(tune.get("metric", "personal/acc"))
    mode = str(tune.get("mode", "max"))
    params = [p for p in space if rows and p in rows[0]]
    # the swept keys drawn log-uniformly get log axes
    log_params = [k for k, v in space.items() if isinstance(v, Mapping) and "loguniform" in v]
    # a validation metric ranks; the test accuracy of the same round is shown, never ranked on
    shown = [metric] + ([TEST_METRIC] if is_validation_metric(metric) else [])
    names = [f"{m} (test)" if m != metric else m for m in shown]
    header = ["trial", *params, *names, "rounds", "status", "run", "MLflow run"]
    body = []
    for r in rows:
        body.append(
            [
                r.get("trial", ""),
                *(_short(r.get(p)) for p in params),
                *(r.get(m) for m in shown),
                r.get("rounds"),
                r.get("status", "") + (f": {r['error']}" if r.get("error") else ""),
                *run_links(out_dir, ["trials", str(r.get("trial", ""))], ""),
            ]
        )
    classes = ["failed" if r.get("status") == "error" else "" for r in rows]
    sections = [("Trials", table(header, body, classes))]
    best = best_row(rows, metric, mode)
    if best is not None:
        best_rows = [[p, _short(best.get(p))] for p in params]
        best_rows += [[n, best.get(m)] for n, m in zip(names, shown)]
        where = "validation data" if is_validation_metric(metric) else "TEST data"
        text = f"<p>trial {esc(best.get('trial', ''))} ({esc(mode)} {esc(metric)}, chosen on {where})</p>"
        text += table(["parameter", "value"], best_rows)
        if is_file(out_dir / "best_config.yaml"):
            text += (
                "<details><summary>its full config (best_config.yaml: rayfl run "
                "best_config.yaml repeats it)</summary>"
                f"<pre>{esc(gate.read_text(out_dir / 'best_config.yaml'))}</pre></details>"
            )
        sections.append(("Best trial", text))
    curves: dict[str, list[tuple[int, float]]] = {}
    for r in rows[:MAX_DRAWN]:
        try:
            with gate.Folder(out_dir).sub(f"trials/{r.get('trial', '')}") as trial:
                history = read_history(trial.path / "metrics.parquet")
        except (FileNotFoundError, UserError):  # not a real folder inside the sweep's
            history = []
        points = [
            (int(h["round"]), float(h[metric]))
            for h in history
            if isinstance(h.get(metric), float) and math.isfinite(h[metric])
        ]
        if points:
            label = ", ".join(f"{p.rsplit('.', 1)[-1]}={_short(r.get(p))}" for p in params)
            curves[f"{r.get('trial', '')}: {label}" if label else str(r.get("trial"))] = points
    if curves:
        lines = figure(partial(plot_compare, curves, ylabel=metric), "per-trial curves")
        sections.append((f"{metric} by round, one line per trial", lines))
    if rows and params:
        note = ""
        if log_params:
            note = f'<p class="note">log axes: {esc(", ".join(log_params))} (sampled log-uniformly)</p>'
        scatter = figure(
            partial(plot_metric_vs_params, rows, metric, params, log_params=log_params),
            "metric vs params",
        )
        sections.append((f"{metric} against each parameter", scatter + note))
    return page(f"Sweep {out_dir.name}", f"{len(rows)} trials, metric {metric}", sections)
