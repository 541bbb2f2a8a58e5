"""The three pages of `rayfl report`: a run directory's (`summary.json`), a suite folder's
(`rayfl compare`: `runs.parquet`, `results.parquet`) and a sweep folder's (`rayfl tune`:
`results.parquet`, `sweep.yaml`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from rayfl import gate
from rayfl.errors import UserError
from rayfl.report.page import (
    MAX_DRAWN,
    arch_bars,
    capped,
    esc,
    figure,
    image,
    is_file,
    page,
    read_history,
    run_links,
    table,
)
from rayfl.tables import read_table


def _final_rows(final: Mapping[str, Any], targets: Sequence[Any] = ()) -> list[list[Any]]:
    """The final-metrics table's rows: what the run measured, in a reader's order."""
    rows: list[list[Any]] = []

    def add(label: str, key: str) -> None:
        if key in final and final[key] is not None:
            rows.append([label, final[key]])

    add("personalized accuracy, last round (personal/acc)", "personal/acc")
    if final.get("personal/acc_ci95") is not None:
        mean, ci = final.get("personal/acc_mean", float("nan")), final["personal/acc_ci95"]
        rows.append(["client mean ± 95% confidence interval", f"{mean:.4f} ± {ci:.4f}"])
    add("validation accuracy, last round (personal/val_acc)", "personal/val_acc")
    if final.get("at_best_val/round") is not None:
        chosen = f"personalized accuracy at the best validation round ({int(final['at_best_val/round'])})"
        add(chosen, "at_best_val/personal/acc")
    for key in ("personal/loss", "personal/val_loss"):
        add(key, key)
    for target in targets:
        t = f"{float(target):g}"
        rounds, b = final.get(f"rounds_to/acc_{t}"), final.get(f"bytes_to/acc_{t}")
        sec = final.get(f"seconds_to/acc_{t}")
        reached = "not reached"
        if rounds is not None:
            reached = f"round {rounds:g}, {(b or 0) / 1e6:.2f} MB, {sec or 0:.1f} s"
        rows.append([f"to personal/acc {t}", reached])
    if "baseline/local_acc" in final:
        add("local-only accuracy, same partition (baseline/local_acc)", "baseline/local_acc")
        gain = final.get("baseline/gain_points") or 0.0
        rows.append(["gain over local training (points)", f"{gain:+.2f}"])
    if "baseline/control_acc" in final:
        add("no-federation control (baseline/control_acc)", "baseline/control_acc")
        gain = final.get("baseline/federated_gain_points") or 0.0
        rows.append(["federated gain over the control (points)", f"{gain:+.2f}"])
    for key in ("personal/acc_mean", "personal/acc_std", "personal/acc_worst10"):
        add(key, key)
    for key in sorted(k for k in final if k.endswith("/acc") and k.count("/") == 1):
        if key != "personal/acc":
            add(key, key)
    add("pfedes/kl_local_proxy", "pfedes/kl_local_proxy")
    for way in ("up", "down"):
        total = final.get(f"comm/bytes_{way}_total")
        if total is not None:
            rows.append([f"communication {way}, MB in all", f"{total / 1e6:.2f}"])
    return rows


def run_report(run_dir: Path) -> str:
    from rayfl.engine.rundir import read_summary
    from rayfl.tracking.plots import default_keys, plot_cost_curves, plot_learning_curves

    summary = read_summary(run_dir)
    final = summary.get("final", {})
    cfg = summary.get("config", {})
    history = read_history(run_dir / "metrics.parquet")
    algo = _section(cfg, "algorithm").get("name", "?")
    data = _section(cfg, "data")
    subtitle = (
        f"{algo} on {data.get('dataset', '?')}, {data.get('num_clients', '?')} clients, "
        f"seed {summary.get('seed')}, {summary.get('rounds')} rounds, status "
        f"{summary.get('status')}, wall time {summary.get('wall_s', 0):.0f} s"
    )
    targets = _section(cfg, "eval").get("targets")
    targets = [t for t in targets if isinstance(t, int | float)] if type(targets) is list else []
    sections = [("Final metrics", table(["metric", "value"], _final_rows(final, targets)))]
    if history:
        keys, note = capped(list(default_keys(history)), MAX_DRAWN, "metrics")
        curves = figure(partial(plot_learning_curves, history, keys=keys), "learning curves")
        sections.append(("Learning curves", curves + note))
    for what, tag in (("architecture", "arch="), ("domain", "domain=")):
        values = _tagged(final, f"personal/acc/{tag}")
        shown, note = capped(sorted(values), MAX_DRAWN, f"{what}s")
        if not shown:
            continue
        groups = {algo: {a: values[a] for a in shown}}
        if local := _tagged(final, f"baseline/local_acc/{tag}"):
            groups["local-only"] = local
        body = [[a, *(g.get(a, float("nan")) for g in groups.values())] for a in shown]
        bars = figure(arch_bars(groups, xlabel=what), f"per {what}")
        content = table([what, *groups], body) + bars + note
        sections.append((f"Personalized accuracy per {what}", content))
    if history:
        cost = figure(partial(plot_cost_curves, {algo: [history]}), "accuracy vs cost")
        sections.append(("Accuracy against communication and time", cost))
    if is_file(run_dir / "label_distribution.png"):
        labels = image(run_dir / "label_distribution.png", "label distribution")
        sections.append(("Label distribution", labels))
    if is_file(run_dir / "config.yaml"):
        sections.append(("Config", f"<pre>{esc(gate.read_text(run_dir / 'config.yaml'))}</pre>"))
    return page(f"Run {summary.get('name', run_dir.name)}", subtitle, sections)


def _tagged(final: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """`{tag: value}` of the final metrics `<prefix><tag>` (an architecture, a domain)."""
    return {k[len(prefix) :]: v for k, v in final.items() if k.startswith(prefix) and v is not None}


def _section(cfg: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = cfg.get(name)
    return value if isinstance(value, dict) else {}


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
