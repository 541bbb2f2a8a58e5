"""The report of a suite folder (`rayfl compare`: `runs.parquet`, `results.parquet`)."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

from rayfl import gate
from rayfl.report.page import (
    MAX_DRAWN,
    arch_bars,
    capped,
    figure,
    is_file,
    page,
    read_history,
    run_links,
    table,
)
from rayfl.tables import read_table


def _run_path(row: Mapping[str, Any]) -> list[str]:
    """A suite run's directory as parts relative to the suite folder: `[setting/]label/seedN`."""
    setting = [str(row["setting"])] if row["setting"] else []
    return [*setting, str(row["label"]), f"seed{row['seed']}"]


def suite_report(out_dir: Path) -> str:
    from rayfl.compare.results import (
        ARCH_PREFIX,
        DOMAIN_PREFIX,
        PERSONAL,
        aggregate,
        arch_rows,
        curves_and_spread,
        mean_col,
        std_col,
        table_rows,
    )
    from rayfl.tracking.plots import plot_compare, plot_cost_curves

    runs = read_table(out_dir / "runs.parquet")
    finished = is_file(out_dir / "results.parquet")
    # a suite still running or interrupted has no results yet: aggregate the runs done so far
    results = read_table(out_dir / "results.parquet") if finished else aggregate(runs)
    sections: list[tuple[str, str]] = []
    for setting in dict.fromkeys(r["setting"] for r in results):
        rows = [r for r in results if r["setting"] == setting]
        suffix = f" ({setting})" if setting else ""
        sections.append((f"Comparison{suffix}", table(*table_rows(rows))))
        for prefix, what in ((ARCH_PREFIX, "architecture group"), (DOMAIN_PREFIX, "domain")):
            header, body = arch_rows(rows, prefix)
            if not header:
                continue
            groups, errors = {}, {}
            archs, drawn_note = capped(header[1:], MAX_DRAWN, what.split()[0] + "s")
            for r in rows:
                groups[r["label"]] = {
                    a: v for a in archs if (v := r.get(mean_col(prefix + a))) is not None
                }
                errors[r["label"]] = {
                    a: v for a in archs if (v := r.get(std_col(prefix + a))) is not None
                }
            bars = figure(arch_bars(groups, errors=errors, xlabel=what.split()[0]), f"per {what}")
            note = '<p class="note">bars: mean over seeds; whiskers: std over seeds</p>'
            content = table(header, body) + bars + drawn_note + note
            sections.append((f"Personalized accuracy per {what}{suffix}", content))
        histories: dict[str, list[Any]] = {}
        for run in runs:
            if run["setting"] == setting and run["status"] == "FINISHED":
                with gate.Folder(out_dir).sub("/".join(_run_path(run))) as d:
                    history = read_history(d.path / "metrics.parquet")
                if history:
                    histories.setdefault(run["label"], []).append(history)
        if histories:
            means, spread = curves_and_spread(histories, PERSONAL)
            seeds = max(len(h) for h in histories.values())
            band = "mean ± std over seeds (band)" if seeds > 1 else "one seed"
            curves = figure(partial(plot_compare, means, ylabel=PERSONAL, spread=spread), "curves")
            sections.append((f"Personalized accuracy by round, {band}{suffix}", curves))
            mean = "mean over seeds" if seeds > 1 else "one seed"
            cost = figure(partial(plot_cost_curves, histories), "accuracy vs cost")
            sections.append(
                (f"Personalized accuracy against communication and time, {mean}{suffix}", cost)
            )
    settings = any(r["setting"] for r in runs)
    header = ["algorithm", "seed", "status", PERSONAL, "rounds", "run directory", "MLflow run"]
    header = ["setting", *header] if settings else header
    run_rows: list[list[Any]] = []
    for r in runs:
        shown = f"{r['setting'] + '/' if r['setting'] else ''}{r['label']}/seed{r['seed']}"
        status = f"{r['status']}: {r['error']}" if r.get("error") else r["status"]
        cells = [r["label"], r["seed"], status, r.get(PERSONAL), r["rounds"]]
        cells += run_links(out_dir, _run_path(r), str(r.get("mlflow_run_id") or ""), shown)
        run_rows.append([r["setting"], *cells] if settings else cells)
    classes = ["failed" if r["status"] != "FINISHED" else "" for r in runs]
    sections.append(("Runs", table(header, run_rows, classes)))
    table_txt = out_dir / "table.txt"
    if finished and is_file(table_txt):
        first = (gate.read_text(table_txt).splitlines() or [""])[0]
    else:
        first = (
            f"not finished (interrupted or still running): {len(runs)} runs done so far; rerun "
            "its rayfl compare command with the same --out to complete it"
        )
    return page(f"Suite {out_dir.name}", first, sections)
