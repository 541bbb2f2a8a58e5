"""`rayfl report DIR`: one self-contained HTML page for a run, a suite or a sweep directory.

Everything is inline (CSS, figures as base64 PNG), so the page can be mailed or opened from an
artifact store. What is on it depends on the folder:

- a run (`summary.json`): the final metrics (with the local-only baseline and gain when the run
  measured them), learning curves one metric per panel, personalized accuracy per architecture
  (and per domain, with `data.domains`) as bars, the clients' label distribution, the config;
- a suite (`results.parquet` + `runs.parquet`): the comparison table, accuracy per architecture
  group and per domain (tables and bars), mean learning curves, every run with its status and error;
- a sweep (`results.parquet` + `sweep.yaml`): the trials table, the best trial, the metric
  against each swept parameter.

The folder is untrusted input (docs/security.md): its files are read through
:mod:`rayfl.safefile` (no symlink followed, sizes and JSON depth bounded), a suite's run
directories must lie inside the suite folder, a malformed file stops the report with one line,
and the page is written by an atomic rename (a link planted at `report.html` is replaced).
"""

from __future__ import annotations

import base64
import html
import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from rayfl.errors import UserError
from rayfl.safefile import MIB, is_file, read_bytes, read_table, read_text, real_dir, write_atomic

CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2rem auto;
       max-width: 1100px; color: #222; padding: 0 1rem; }
h1 { font-size: 1.5rem; margin-bottom: .2rem; } h2 { font-size: 1.15rem; margin-top: 2rem;
     border-bottom: 1px solid #ddd; padding-bottom: .2rem; }
.sub { color: #666; margin-top: 0; }
table { border-collapse: collapse; margin: .5rem 0; font-size: .9rem; }
th, td { border: 1px solid #ddd; padding: .25rem .6rem; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
th { background: #f4f6f8; }
tr.failed td { background: #fdecea; }
.gain { font-weight: bold; color: #1b7f3b; } .loss { font-weight: bold; color: #b3261e; }
img { max-width: 100%; border: 1px solid #eee; margin: .5rem 0; }
pre { background: #f7f7f7; padding: .6rem; overflow-x: auto; font-size: .8rem; }
details summary { cursor: pointer; color: #555; margin: .4rem 0; }
.note { color: #555; font-size: .9rem; }
"""


def _esc(value: Any) -> str:
    return html.escape(str(value))


def _fmt(value: Any, digits: int = 4) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


class Html(str):
    """A table cell that is already HTML (a link): `table` does not escape it."""


def link(href: str, text: str, title: str = "") -> Html:
    """An `<a>` cell; `href` and `text` are escaped."""
    tip = f' title="{_esc(title)}"' if title else ""
    return Html(f'<a href="{_esc(href)}"{tip}>{_esc(text)}</a>')


def _cell(value: Any) -> str:
    if isinstance(value, Html):
        return f"<td>{value}</td>"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f'<td class="num">{_esc(_fmt(value))}</td>'
    return f"<td>{_esc(value)}</td>"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], classes: Sequence[str] = ()) -> str:
    """An HTML table; numbers right-aligned, `Html` cells as they are, `classes[i]` on row i."""
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{classes[i]}"' if i < len(classes) and classes[i] else ""
        cells = "".join(_cell(c) for c in row)
        body.append(f"<tr{cls}>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def image(path: Path, alt: str) -> str:
    """A PNG file inlined as a base64 data URI."""
    data = base64.b64encode(read_bytes(path, 64 * MIB)).decode()
    return f'<img alt="{_esc(alt)}" src="data:image/png;base64,{data}">'


def figure(draw: Callable[[Path], Any], alt: str) -> str:
    """Render a plot function into a temporary PNG and inline it."""
    with tempfile.TemporaryDirectory(prefix="rayfl-report-") as tmp:
        path = Path(tmp) / "figure.png"
        draw(path)
        return image(path, alt)


def page(title: str, subtitle: str, sections: Sequence[tuple[str, str]]) -> str:
    body = "".join(f"<h2>{_esc(h)}</h2>{content}" for h, content in sections if content)
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{_esc(title)}</title><style>{CSS}</style></head><body>"
        f'<h1>{_esc(title)}</h1><p class="sub">{_esc(subtitle)}</p>{body}</body></html>'
    )


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    return read_table(path)


def _history(path: Path) -> list[dict[str, Any]]:
    """A run's metrics.parquet: rows of numbers (or nulls), else one line."""
    rows = read_table(path)
    for row in rows:
        for key, value in row.items():
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float)
            ):
                raise UserError(
                    f"{path}: column {key!r} holds {type(value).__name__} values, not numbers; "
                    "it was not written by rayfl (or was changed since): restore or remove it"
                )
    return rows


# --------------------------------------------------------------------------- a run


def _final_rows(
    final: Mapping[str, Any], targets: Sequence[Any] = ()
) -> tuple[list[list[Any]], list[str]]:
    rows: list[list[Any]] = []
    classes: list[str] = []

    def add(label: str, key: str, cls: str = "") -> None:
        if key in final and final[key] is not None:
            rows.append([label, final[key]])
            classes.append(cls)

    add("personalized accuracy, last round (personal/acc)", "personal/acc")
    if final.get("personal/acc_ci95") is not None:
        rows.append(
            [
                "client mean ± 95% confidence interval",
                f"{final.get('personal/acc_mean', float('nan')):.4f} ± "
                f"{final['personal/acc_ci95']:.4f}",
            ]
        )
        classes.append("")
    add("validation accuracy, last round (personal/val_acc)", "personal/val_acc")
    if final.get("at_best_val/round") is not None:
        chosen = int(final["at_best_val/round"])
        add(
            f"personalized accuracy at the best validation round ({chosen})",
            "at_best_val/personal/acc",
        )
    for key in ("personal/loss", "personal/val_loss"):
        add(key, key)
    for target in targets:
        t = f"{float(target):g}"
        rounds, b = final.get(f"rounds_to/acc_{t}"), final.get(f"bytes_to/acc_{t}")
        sec = final.get(f"seconds_to/acc_{t}")
        reached = (
            "not reached"
            if rounds is None
            else f"round {rounds:g}, {(b or 0) / 1e6:.2f} MB, {sec or 0:.1f} s"
        )
        rows.append([f"to personal/acc {t}", reached])
        classes.append("")
    if "baseline/local_acc" in final:
        add("local-only accuracy, same partition (baseline/local_acc)", "baseline/local_acc")
        gain = final.get("baseline/gain_points") or 0.0
        rows.append(["gain over local training (points)", f"{gain:+.2f}"])
        classes.append("")
    if "baseline/control_acc" in final:
        add("no-federation control (baseline/control_acc)", "baseline/control_acc")
        gain = final.get("baseline/federated_gain_points") or 0.0
        rows.append(["federated gain over the control (points)", f"{gain:+.2f}"])
        classes.append("")
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
            classes.append("")
    return rows, classes


def _arch_bars(
    groups: Mapping[str, Mapping[str, float]],
    path: Path,
    title: str = "",
    errors: Mapping[str, Mapping[str, float]] | None = None,
    xlabel: str = "architecture",
) -> Path:
    from rayfl.tracking.plots import plot_bars

    return plot_bars(
        groups, path, ylabel="personalized accuracy", title=title, errors=errors, xlabel=xlabel
    )


def run_report(run_dir: Path) -> str:
    from rayfl.engine.rundir import check_run_dir, read_summary
    from rayfl.tracking.plots import plot_cost_curves, plot_learning_curves

    check_run_dir(run_dir)
    summary = read_summary(run_dir)
    final = summary.get("final", {})
    cfg = summary.get("config", {})
    history = _history(run_dir / "metrics.parquet")
    algo = _section(cfg, "algorithm").get("name", "?")
    data = _section(cfg, "data")
    subtitle = (
        f"{algo} on {data.get('dataset', '?')}, {data.get('num_clients', '?')} clients, "
        f"seed {summary.get('seed')}, {summary.get('rounds')} rounds, status "
        f"{summary.get('status')}, wall time {summary.get('wall_s', 0):.0f} s"
    )
    targets = _section(cfg, "eval").get("targets") or []
    targets = (
        [t for t in targets if isinstance(t, int | float)] if isinstance(targets, list) else []
    )
    rows, classes = _final_rows(final, targets)
    sections = [("Final metrics", table(["metric", "value"], rows, classes))]
    if history:
        sections.append(
            (
                "Learning curves",
                figure(lambda p: plot_learning_curves(history, p), "learning curves"),
            )
        )
    arch = {
        k.split("arch=", 1)[1]: v
        for k, v in final.items()
        if k.startswith("personal/acc/arch=") and v is not None
    }
    if arch:
        groups = {algo: arch}
        local = {
            k.split("arch=", 1)[1]: v
            for k, v in final.items()
            if k.startswith("baseline/local_acc/arch=") and v is not None
        }
        if local:
            groups["local-only"] = local
        header = ["architecture", *groups]
        body = [[a, *(groups[g].get(a, float("nan")) for g in groups)] for a in sorted(arch)]
        sections.append(
            (
                "Personalized accuracy per architecture",
                table(header, body) + figure(partial(_arch_bars, groups), "per architecture"),
            )
        )
    domain = {
        k.split("domain=", 1)[1]: v
        for k, v in final.items()
        if k.startswith("personal/acc/domain=") and v is not None
    }
    if domain:
        groups = {algo: domain}
        body = [[d, v] for d, v in sorted(domain.items())]
        sections.append(
            (
                "Personalized accuracy per domain",
                table(["domain", algo], body)
                + figure(partial(_arch_bars, groups, xlabel="domain"), "per domain"),
            )
        )
    if history:
        sections.append(
            (
                "Accuracy against communication and time",
                figure(lambda p: plot_cost_curves({algo: [history]}, p), "accuracy vs cost"),
            )
        )
    if is_file(run_dir / "label_distribution.png"):
        sections.append(
            ("Label distribution", image(run_dir / "label_distribution.png", "label distribution"))
        )
    if is_file(run_dir / "config.yaml"):
        sections.append(("Config", f"<pre>{_esc(read_text(run_dir / 'config.yaml'))}</pre>"))
    return page(f"Run {summary.get('name', run_dir.name)}", subtitle, sections)


def _section(cfg: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = cfg.get(name)
    return value if isinstance(value, dict) else {}


# --------------------------------------------------------------------------- a suite


def _run_path(out_dir: Path, row: Mapping[str, Any]) -> Path:
    """A suite run's directory: where the suite lays it out under `out_dir` (the folder may have
    moved since, e.g. copied home from a cluster), else the path the row recorded."""
    inside = out_dir / (row["setting"] or ".") / str(row["label"]) / f"seed{row['seed']}"
    if os.path.lexists(inside):  # a suite folder is untrusted: a real folder inside it
        return real_dir(inside, inside=out_dir)
    return _inside(out_dir, row["run_dir"])


def run_links(run_dir: Path, page_dir: Path, mlflow_id: str, text: str = "") -> tuple[Any, Any]:
    """Cells linking a run: its directory (its own report.html when it has one), relative to the
    page so that the folder can move; and its MLflow run, a link when the store is a server,
    else the run id (`mlflow ui --backend-store-uri URI` opens a local store)."""
    import os

    from rayfl.engine.rundir import read_mlflow_run

    target = run_dir / "report.html" if (run_dir / "report.html").is_file() else run_dir
    rel = os.path.relpath(target.resolve(), page_dir.resolve()) if run_dir.exists() else ""
    dir_cell: Any = link(rel, text or run_dir.name, str(run_dir)) if rel else str(run_dir)
    ref = read_mlflow_run(run_dir) if run_dir.exists() else None
    run_id = mlflow_id or (ref or {}).get("run_id", "")
    uri = (ref or {}).get("tracking_uri", "")
    if run_id and uri.startswith(("http://", "https://")):
        return dir_cell, link(f"{uri.rstrip('/')}/#/runs/{run_id}", run_id[:8], run_id)
    return dir_cell, Html(f'<span title="{_esc(uri)}">{_esc(run_id)}</span>') if run_id else "-"


def suite_report(out_dir: Path, page_dir: Path | None = None) -> str:
    from rayfl.compare import (
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

    page_dir = page_dir or out_dir
    runs = _read_parquet(out_dir / "runs.parquet")
    finished = is_file(out_dir / "results.parquet")
    # a suite still running or interrupted has no results yet: aggregate the runs done so far
    results = _read_parquet(out_dir / "results.parquet") if finished else aggregate(runs)
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
            for r in rows:
                archs = header[1:]
                groups[r["label"]] = {
                    a: v for a in archs if (v := r.get(mean_col(prefix + a))) is not None
                }
                errors[r["label"]] = {
                    a: v for a in archs if (v := r.get(std_col(prefix + a))) is not None
                }
            draw = partial(_arch_bars, groups, errors=errors, xlabel=what.split()[0])
            sections.append(
                (
                    f"Personalized accuracy per {what}{suffix}",
                    table(header, body)
                    + figure(draw, f"per {what}")
                    + '<p class="note">bars: mean over seeds; whiskers: std over seeds</p>',
                )
            )
        histories: dict[str, list[Any]] = {}
        for run in runs:
            if run["setting"] == setting and run["status"] == "FINISHED":
                history = _history(_run_path(out_dir, run) / "metrics.parquet")
                if history:
                    histories.setdefault(run["label"], []).append(history)
        if histories:
            means, spread = curves_and_spread(histories, PERSONAL)
            seeds = max(len(h) for h in histories.values())
            band = "mean ± std over seeds (band)" if seeds > 1 else "one seed"
            sections.append(
                (
                    f"Personalized accuracy by round, {band}{suffix}",
                    figure(partial(plot_compare, means, ylabel=PERSONAL, spread=spread), "curves"),
                )
            )
            mean = "mean over seeds" if seeds > 1 else "one seed"
            sections.append(
                (
                    f"Personalized accuracy against communication and time, {mean}{suffix}",
                    figure(partial(plot_cost_curves, histories), "accuracy vs cost"),
                )
            )
    settings = any(r["setting"] for r in runs)
    header = ["algorithm", "seed", "status", PERSONAL, "rounds", "run directory", "MLflow run"]
    header = ["setting", *header] if settings else header
    run_rows: list[list[Any]] = []
    for r in runs:
        shown = f"{r['setting'] + '/' if r['setting'] else ''}{r['label']}/seed{r['seed']}"
        status = f"{r['status']}: {r['error']}" if r.get("error") else r["status"]
        cells = [r["label"], r["seed"], status, r.get(PERSONAL), r["rounds"]]
        try:
            path = _run_path(out_dir, r)
        except UserError:  # not (or no longer) a real folder inside the suite: no links
            cells += [shown, r.get("mlflow_run_id") or ""]
        else:
            cells += run_links(path, page_dir, r.get("mlflow_run_id") or "", shown)
        run_rows.append([r["setting"], *cells] if settings else cells)
    classes = ["failed" if r["status"] != "FINISHED" else "" for r in runs]
    sections.append(("Runs", table(header, run_rows, classes)))
    table_txt = out_dir / "table.txt"
    if finished and is_file(table_txt):
        first = (read_text(table_txt).splitlines() or [""])[0]
    else:
        first = (
            f"not finished (interrupted or still running): {len(runs)} runs done so far; rerun "
            "its rayfl compare command with the same --out to complete it"
        )
    return page(f"Suite {out_dir.name}", first, sections)


# --------------------------------------------------------------------------- a sweep


def _log_sampled(space: Mapping[str, Any]) -> list[str]:
    """The swept keys drawn log-uniformly (`{loguniform: [low, high]}`): their axes are log."""
    return [k for k, spec in space.items() if isinstance(spec, Mapping) and "loguniform" in spec]


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def sweep_report(out_dir: Path, page_dir: Path | None = None) -> str:
    from rayfl.config import parse_yaml
    from rayfl.tracking.plots import plot_compare, plot_metric_vs_params
    from rayfl.tune.sweep import TEST_METRIC, is_validation_metric

    page_dir = page_dir or out_dir
    rows = _read_parquet(out_dir / "results.parquet")
    raw = parse_yaml(read_text(out_dir / "sweep.yaml"), out_dir / "sweep.yaml")  # depth-bounded
    sweep = raw.get("sweep", {}) if isinstance(raw.get("sweep"), dict) else {}
    space_spec = raw.get("space") or sweep.get("space") or {}
    space = list(space_spec.keys())
    tune = raw.get("tune") or sweep.get("tune") or {}
    metric = str(tune.get("metric", "personal/acc"))
    mode = str(tune.get("mode", "max"))
    params = [p for p in space if rows and p in rows[0]] or [
        k for k in (rows[0] if rows else {}) if k.startswith(("algorithm.", "train.", "data."))
    ]
    log_params = _log_sampled(space_spec) if isinstance(space_spec, Mapping) else []
    # a validation metric ranks; the test accuracy of the same round is shown, never ranked on
    shown = [metric] + ([TEST_METRIC] if is_validation_metric(metric) else [])
    names = [f"{m} (test)" if m != metric else m for m in shown]
    header = ["trial", *params, *names, "rounds", "status", "run", "MLflow run"]
    body = []
    for r in rows:
        run_dir = out_dir / "trials" / str(r.get("trial", ""))
        body.append(
            [
                r.get("trial", ""),
                *(_short(r.get(p)) for p in params),
                *(r.get(m) for m in shown),
                r.get("rounds"),
                r.get("status", "") + (f": {r['error']}" if r.get("error") else ""),
                *run_links(run_dir, page_dir, ""),
            ]
        )
    classes = ["failed" if r.get("status") == "error" else "" for r in rows]
    sections = [("Trials", table(header, body, classes))]
    scored = [r for r in rows if isinstance(r.get(metric), float) and math.isfinite(r[metric])]
    if scored:
        best = (max if mode == "max" else min)(scored, key=lambda r: r[metric])
        best_rows = [[p, _short(best.get(p))] for p in params]
        best_rows += [[n, best.get(m)] for n, m in zip(names, shown)]
        where = "validation data" if is_validation_metric(metric) else "TEST data"
        text = (
            f"<p>trial {_esc(best.get('trial', ''))} ({mode} {_esc(metric)}, chosen on {where})</p>"
        )
        text += table(["parameter", "value"], best_rows)
        if is_file(out_dir / "best_config.yaml"):
            text += (
                "<details><summary>its full config (best_config.yaml: rayfl run "
                "best_config.yaml repeats it)</summary>"
                f"<pre>{_esc(read_text(out_dir / 'best_config.yaml'))}</pre></details>"
            )
        sections.append(("Best trial", text))
    curves: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        history = _history(out_dir / "trials" / str(r.get("trial", "")) / "metrics.parquet")
        points = [
            (int(h["round"]), float(h[metric]))
            for h in history
            if isinstance(h.get(metric), float) and math.isfinite(h[metric])
        ]
        if points:
            label = ", ".join(f"{p.rsplit('.', 1)[-1]}={_short(r.get(p))}" for p in params)
            curves[f"{r.get('trial', '')}: {label}" if label else str(r.get("trial"))] = points
    if curves:
        sections.append(
            (
                f"{metric} by round, one line per trial",
                figure(partial(plot_compare, curves, ylabel=metric), "per-trial curves"),
            )
        )
    if rows and params:
        note = (
            f'<p class="note">log axes: {_esc(", ".join(log_params))} (sampled log-uniformly)</p>'
            if log_params
            else ""
        )
        sections.append(
            (
                f"{metric} against each parameter",
                figure(
                    lambda p: plot_metric_vs_params(rows, metric, params, p, log_params),
                    "metric vs params",
                )
                + note,
            )
        )
    return page(f"Sweep {out_dir.name}", f"{len(rows)} trials, metric {metric}", sections)


# --------------------------------------------------------------------------- entry point


def _inside(folder: Path, name: Any) -> Path:
    """The run directory ``name`` (from a suite's runs.parquet) if it is a real directory
    inside ``folder``; else one line."""
    path = Path(str(name))  # as compare wrote it: relative to where it ran, or absolute
    if not os.path.lexists(path):
        path = folder / path.name  # the suite folder was moved
    return real_dir(path, inside=folder)


def kind_of(path: Path) -> str:
    """`run`, `suite` or `sweep`, from the files the folder holds."""
    if is_file(path / "summary.json"):
        return "run"
    if is_file(path / "runs.parquet") or is_file(path / "suite.yaml"):
        return "suite"  # finished, or partly: runs.parquet grows as runs finish
    if is_file(path / "results.parquet") and is_file(path / "sweep.yaml"):
        return "sweep"
    raise UserError(
        f"rayfl report {path}: not a run directory (summary.json), a suite folder "
        "(suite.yaml, runs.parquet) or a sweep folder (results.parquet + sweep.yaml); "
        "pass a folder written by rayfl run --out, rayfl compare or rayfl tune"
    )


def write_report(path: str | Path, out: str | Path | None = None) -> Path:
    """Write the HTML page for folder `path` (default `<path>/report.html`); returns its path."""
    folder = Path(path)
    if not folder.is_dir():
        raise UserError(f"rayfl report {folder}: no such folder")
    kind = kind_of(folder)
    target = Path(out) if out else folder / "report.html"
    if target.is_dir():
        raise UserError(f"rayfl report --out {target}: a folder; name the page's file instead")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(
            f"rayfl report --out {target}: cannot create its folder ({exc.strerror}); "
            "choose another --out"
        ) from None
    try:
        if kind == "run":
            text = run_report(folder)
        else:  # links to run directories are relative to the page
            text = (suite_report if kind == "suite" else sweep_report)(folder, target.parent)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        # a field of the right type but an unexpected shape (rayfl did not write it)
        raise UserError(
            f"rayfl report {folder}: a file there is malformed ({type(exc).__name__}: "
            f"{str(exc)[:80]}); restore it from the run, or rerun"
        ) from None
    write_atomic(target, text.encode("utf-8"))
    return target
