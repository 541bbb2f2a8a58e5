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

Every file is read through :mod:`rayfl.gate` (authenticated, or with ``--untrusted`` only
bounded); the page draws at most ``MAX_DRAWN`` metrics and architectures and lists at most
``MAX_ROWS`` rows per table, saying what it left out; every string is escaped and every link is
a relative path inside the folder.
"""

from __future__ import annotations

import base64
import html
import math
import tempfile
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from rayfl import gate
from rayfl.errors import UserError
from rayfl.tables import read_table

MAX_DRAWN = 24  # metrics (one panel each) and architectures (bars) drawn
MAX_ROWS = 500  # rows of a table, and architectures listed

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


def link(parts: Sequence[str], text: str) -> Html:
    """An `<a>` cell to the relative path `parts` inside the folder: `./` first and every part
    percent-quoted, so that no label (`javascript:...`) becomes a scheme."""
    href = "./" + "/".join(urllib.parse.quote(str(p), safe="") for p in parts)
    return Html(f'<a href="{_esc(href)}">{_esc(text)}</a>')


def capped(items: Sequence[Any], limit: int, what: str) -> tuple[list[Any], str]:
    """The first `limit` items, and a note saying how many were left out ('' if none)."""
    left = len(items) - limit
    note = f'<p class="note">{left} more {_esc(what)} not shown</p>' if left > 0 else ""
    return list(items[:limit]), note


def _cell(value: Any) -> str:
    if isinstance(value, Html):
        return f"<td>{value}</td>"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f'<td class="num">{_esc(_fmt(value))}</td>'
    return f"<td>{_esc(value)}</td>"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], classes: Sequence[str] = ()) -> str:
    """An HTML table; numbers right-aligned, `Html` cells as they are, `classes[i]` on row i."""
    header, note = capped(header, MAX_ROWS, "columns")
    rows, more = capped(rows, MAX_ROWS, "rows")
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = []
    for i, row in enumerate(rows):
        row = row[: len(header)]
        cls = f' class="{classes[i]}"' if i < len(classes) and classes[i] else ""
        cells = "".join(_cell(c) for c in row)
        body.append(f"<tr{cls}>{cells}</tr>")
    table = f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
    return table + note + more


def image(path: Path, alt: str) -> str:
    """A PNG file inlined as a base64 data URI."""
    data = base64.b64encode(gate.read(path, 64 * gate.MIB)).decode()
    return f'<img alt="{_esc(alt)}" src="data:image/png;base64,{data}">'


def figure(draw: Callable[[Path], Any], alt: str) -> str:
    """Render a plot function into a temporary PNG and inline it."""
    with tempfile.TemporaryDirectory(prefix="rayfl-report-") as tmp:
        path = Path(tmp) / "figure.png"
        with gate.untrusted(False):  # a private temporary folder of this process
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
    """A run's metrics.parquet: rows of numbers ({} cells dropped where they are not)."""
    return [
        {k: v for k, v in row.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        for row in read_table(path)
    ]


def _drawn_curves(history: list[dict[str, Any]]) -> tuple[Callable[[Path], Any], str]:
    """Draw at most MAX_DRAWN of the learning curves' metrics, and say what was left out."""
    from rayfl.tracking.plots import default_keys, plot_learning_curves

    keys, note = capped(list(default_keys(history)), MAX_DRAWN, "metrics")
    return lambda p: plot_learning_curves(history, p, keys=keys), note


def _is_file(path: Path) -> bool:
    """Whether ``path`` is a regular file; a link or special file there is refused."""
    with gate.Folder(path.parent) as folder:
        kind = folder.kind(path.name)
    if kind not in (None, "file"):
        what = "symbolic link" if kind == "link" else kind
        raise gate.refuse(path, f"is a {what}, not a regular file")
    return kind == "file"


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
    from rayfl.engine.rundir import read_summary
    from rayfl.tracking.plots import plot_cost_curves

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
        draw, note = _drawn_curves(history)
        sections.append(("Learning curves", figure(draw, "learning curves") + note))
    arch = {
        k.split("arch=", 1)[1]: v
        for k, v in final.items()
        if k.startswith("personal/acc/arch=") and v is not None
    }
    arch_note = ""
    if len(arch) > MAX_DRAWN:
        shown, arch_note = capped(sorted(arch), MAX_DRAWN, "architectures")
        arch = {a: arch[a] for a in shown}
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
                table(header, body)
                + figure(partial(_arch_bars, groups), "per architecture")
                + arch_note,
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
    if _is_file(run_dir / "label_distribution.png"):
        sections.append(
            ("Label distribution", image(run_dir / "label_distribution.png", "label distribution"))
        )
    if _is_file(run_dir / "config.yaml"):
        sections.append(("Config", f"<pre>{_esc(gate.read_text(run_dir / 'config.yaml'))}</pre>"))
    return page(f"Run {summary.get('name', run_dir.name)}", subtitle, sections)


def _section(cfg: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = cfg.get(name)
    return value if isinstance(value, dict) else {}


# --------------------------------------------------------------------------- a suite


def _run_path(out_dir: Path, row: Mapping[str, Any]) -> list[str]:
    """A suite run's directory as parts relative to the suite folder, where the suite lays it
    out: `[setting/]label/seedN`."""
    return [
        *([str(row["setting"])] if row["setting"] else []),
        str(row["label"]),
        f"seed{row['seed']}",
    ]


def run_links(
    folder: Path, parts: Sequence[str], mlflow_id: str, text: str = ""
) -> tuple[Any, Any]:
    """Cells for a run inside `folder` at the relative `parts`: a link to its report.html (or
    its directory), and its MLflow run id as text (open it with `mlflow ui`). A run directory
    that is not a real folder inside `folder` (a link) gets no link."""
    try:
        with gate.Folder(folder).sub("/".join(parts)) as run:
            page = run.kind("report.html") == "file"
    except (FileNotFoundError, UserError):
        return text or parts[-1], _esc(mlflow_id) or "-"
    target = [*parts, "report.html"] if page else list(parts)
    return link(target, text or parts[-1]), Html(_esc(mlflow_id)) if mlflow_id else "-"


def suite_report(out_dir: Path) -> str:
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

    runs = _read_parquet(out_dir / "runs.parquet")
    finished = _is_file(out_dir / "results.parquet")
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
            archs, drawn_note = capped(header[1:], MAX_DRAWN, what.split()[0] + "s")
            for r in rows:
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
                    + drawn_note
                    + '<p class="note">bars: mean over seeds; whiskers: std over seeds</p>',
                )
            )
        histories: dict[str, list[Any]] = {}
        for run in runs:
            if run["setting"] == setting and run["status"] == "FINISHED":
                with gate.Folder(out_dir).sub("/".join(_run_path(out_dir, run))) as d:
                    history = _history(d.path / "metrics.parquet")
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
        cells += run_links(out_dir, _run_path(out_dir, r), str(r.get("mlflow_run_id") or ""), shown)
        run_rows.append([r["setting"], *cells] if settings else cells)
    classes = ["failed" if r["status"] != "FINISHED" else "" for r in runs]
    sections.append(("Runs", table(header, run_rows, classes)))
    table_txt = out_dir / "table.txt"
    if finished and _is_file(table_txt):
        first = (gate.read_text(table_txt).splitlines() or [""])[0]
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


def sweep_report(out_dir: Path) -> str:
    from rayfl.config import parse_yaml
    from rayfl.tracking.plots import plot_compare, plot_metric_vs_params
    from rayfl.tune.sweep import TEST_METRIC, is_validation_metric

    rows = _read_parquet(out_dir / "results.parquet")
    raw = parse_yaml(gate.read_text(out_dir / "sweep.yaml"), out_dir / "sweep.yaml")
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
    scored = [r for r in rows if isinstance(r.get(metric), float) and math.isfinite(r[metric])]
    if scored:
        best = (max if mode == "max" else min)(scored, key=lambda r: r[metric])
        best_rows = [[p, _short(best.get(p))] for p in params]
        best_rows += [[n, best.get(m)] for n, m in zip(names, shown)]
        where = "validation data" if is_validation_metric(metric) else "TEST data"
        text = f"<p>trial {_esc(best.get('trial', ''))} ({_esc(mode)} {_esc(metric)}, chosen on {where})</p>"
        text += table(["parameter", "value"], best_rows)
        if _is_file(out_dir / "best_config.yaml"):
            text += (
                "<details><summary>its full config (best_config.yaml: rayfl run "
                "best_config.yaml repeats it)</summary>"
                f"<pre>{_esc(gate.read_text(out_dir / 'best_config.yaml'))}</pre></details>"
            )
        sections.append(("Best trial", text))
    curves: dict[str, list[tuple[int, float]]] = {}
    for r in rows[:MAX_DRAWN]:
        try:
            with gate.Folder(out_dir).sub(f"trials/{r.get('trial', '')}") as trial:
                history = _history(trial.path / "metrics.parquet")
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


def kind_of(path: Path) -> str:
    """`run`, `suite` or `sweep`, from the files the folder holds."""
    names = ("summary.json", "runs.parquet", "suite.yaml", "results.parquet", "sweep.yaml")
    has = {n for n in names if _is_file(path / n)}
    if "summary.json" in has:
        return "run"
    if has & {"runs.parquet", "suite.yaml"}:
        return "suite"  # finished, or partly: runs.parquet grows as runs finish
    if {"results.parquet", "sweep.yaml"} <= has:
        return "sweep"
    raise UserError(
        f"rayfl report {path}: not a run directory (summary.json), a suite folder "
        "(suite.yaml, runs.parquet) or a sweep folder (results.parquet + sweep.yaml); "
        "pass a folder written by rayfl run --out, rayfl compare or rayfl tune"
    )


def write_report(path: str | Path, out: str | Path | None = None, untrusted: bool = False) -> Path:
    """Write the HTML page for folder `path` (default `<path>/report.html`); returns its path.
    With `untrusted`, a folder this user's rayfl did not write is read too (bounded, escaped)."""
    import contextlib

    folder = Path(path)
    if not folder.is_dir():
        raise UserError(f"rayfl report {folder}: no such folder")
    target = Path(out) if out else folder / "report.html"
    if target.is_dir():
        raise UserError(f"rayfl report --out {target}: a folder; name the page's file instead")
    with gate.untrusted() if untrusted else contextlib.nullcontext():
        kind = kind_of(folder)
        try:
            maker = {"run": run_report, "suite": suite_report, "sweep": sweep_report}[kind]
            text = maker(folder)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            # a field of an unexpected shape (only from a folder read with --untrusted)
            raise UserError(
                f"rayfl report {folder}: a file there is malformed ({type(exc).__name__}: "
                f"{str(exc)[:80]}); restore it from the run, or rerun"
            ) from None
    with gate.Folder(target.parent, create=True) as where:  # never read back: not recorded
        where.write(target.name, text.encode("utf-8"), record=False)
    return target
