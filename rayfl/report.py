"""`rayfl report DIR`: one self-contained HTML page for a run, a suite or a sweep directory.

Everything is inline (CSS, figures as base64 PNG), so the page can be mailed or opened from an
artifact store. What is on it depends on the folder:

- a run (`summary.json`): the final metrics (with the local-only baseline and gain when the run
  measured them), learning curves one metric per panel, personalized accuracy per architecture
  as bars, the clients' label distribution, the config;
- a suite (`results.parquet` + `runs.parquet`): the comparison table, accuracy per architecture
  group (table and bars), mean learning curves, every run with its status and error;
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
"""


def _esc(value: Any) -> str:
    return html.escape(str(value))


def _fmt(value: Any, digits: int = 4) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], classes: Sequence[str] = ()) -> str:
    """An HTML table; numbers right-aligned, `classes[i]` on row i."""
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{classes[i]}"' if i < len(classes) and classes[i] else ""
        cells = "".join(
            f'<td class="num">{_esc(_fmt(c))}</td>'
            if isinstance(c, int | float) and not isinstance(c, bool)
            else f"<td>{_esc(c)}</td>"
            for c in row
        )
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


def _final_rows(final: Mapping[str, Any]) -> tuple[list[list[Any]], list[str]]:
    rows: list[list[Any]] = []
    classes: list[str] = []

    def add(label: str, key: str, cls: str = "") -> None:
        if key in final and final[key] is not None:
            rows.append([label, final[key]])
            classes.append(cls)

    add("personalized accuracy (personal/acc)", "personal/acc")
    if "baseline/local_acc" in final:
        add("local-only accuracy, same partition (baseline/local_acc)", "baseline/local_acc")
        gain = final.get("baseline/gain_points") or 0.0
        rows.append(["gain over local training (points)", f"{gain:+.2f}"])
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


def _arch_bars(groups: Mapping[str, Mapping[str, float]], path: Path, title: str = "") -> Path:
    from rayfl.tracking.plots import plot_bars

    return plot_bars(groups, path, ylabel="personalized accuracy", title=title)


def run_report(run_dir: Path) -> str:
    from rayfl.engine.rundir import check_run_dir, read_summary
    from rayfl.tracking.plots import plot_learning_curves

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
    rows, classes = _final_rows(final)
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


def suite_report(out_dir: Path) -> str:
    from rayfl.compare import ARCH_PREFIX, PERSONAL, arch_rows, mean_col, mean_curves, table_rows
    from rayfl.tracking.plots import plot_compare

    results = _read_parquet(out_dir / "results.parquet")
    runs = _read_parquet(out_dir / "runs.parquet")
    sections: list[tuple[str, str]] = []
    for setting in dict.fromkeys(r["setting"] for r in results):
        rows = [r for r in results if r["setting"] == setting]
        suffix = f" ({setting})" if setting else ""
        sections.append((f"Comparison{suffix}", table(*table_rows(rows))))
        header, body = arch_rows(rows)
        if header:
            groups = {
                r["label"]: {
                    k[len(ARCH_PREFIX) : -len(mean_col(""))]: v
                    for k, v in r.items()
                    if k.startswith(ARCH_PREFIX) and k.endswith(mean_col("")) and v is not None
                }
                for r in rows
            }
            sections.append(
                (
                    f"Personalized accuracy per architecture group{suffix}",
                    table(header, body) + figure(partial(_arch_bars, groups), "per architecture"),
                )
            )
        histories: dict[str, list[Any]] = {}
        for run in runs:
            if run["setting"] == setting and run["status"] == "FINISHED":
                history = _history(_inside(out_dir, run["run_dir"]) / "metrics.parquet")
                if history:
                    histories.setdefault(run["label"], []).append(history)
        if histories:
            curves = mean_curves(histories, PERSONAL)
            sections.append(
                (
                    f"Personalized accuracy by round, mean over seeds{suffix}",
                    figure(partial(plot_compare, curves, ylabel=PERSONAL), "mean curves"),
                )
            )
    header = ["setting", "algorithm", "seed", "status", PERSONAL, "rounds", "error"]
    run_rows: list[list[Any]] = [
        [
            r["setting"],
            r["label"],
            r["seed"],
            r["status"],
            r.get(PERSONAL),
            r["rounds"],
            r.get("error") or "",
        ]
        for r in runs
    ]
    classes = ["failed" if r["status"] != "FINISHED" else "" for r in runs]
    sections.append(("Runs", table(header, run_rows, classes)))
    table_txt = out_dir / "table.txt"
    first = (read_text(table_txt).splitlines() or [""])[0] if is_file(table_txt) else ""
    return page(f"Suite {out_dir.name}", first, sections)


# --------------------------------------------------------------------------- a sweep


def sweep_report(out_dir: Path) -> str:
    import yaml

    from rayfl.tracking.plots import plot_metric_vs_params

    rows = _read_parquet(out_dir / "results.parquet")
    raw = yaml.safe_load(read_text(out_dir / "sweep.yaml")) or {}
    if not isinstance(raw, dict):
        raise UserError(f"{out_dir / 'sweep.yaml'}: not a mapping; restore the sweep folder")
    sweep = raw.get("sweep", {}) if isinstance(raw.get("sweep"), dict) else {}
    space = list((raw.get("space") or sweep.get("space") or {}).keys())
    tune = raw.get("tune") or sweep.get("tune") or {}
    metric = str(tune.get("metric", "personal/acc"))
    params = [p for p in space if rows and p in rows[0]] or [
        k for k in (rows[0] if rows else {}) if k.startswith(("algorithm.", "train.", "data."))
    ]
    header = ["trial", *params, metric, "rounds", "status"]
    body = [
        [
            r.get("trial", ""),
            *(r.get(p) for p in params),
            r.get(metric),
            r.get("rounds"),
            r.get("status", ""),
        ]
        for r in rows
    ]
    sections = [("Trials", table(header, body))]
    if is_file(out_dir / "best_config.yaml"):
        sections.append(
            ("Best trial", f"<pre>{_esc(read_text(out_dir / 'best_config.yaml'))}</pre>")
        )
    if rows and params:
        sections.append(
            (
                f"{metric} against each parameter",
                figure(
                    lambda p: plot_metric_vs_params(rows, metric, params, p), "metric vs params"
                ),
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
    if is_file(path / "results.parquet") and is_file(path / "runs.parquet"):
        return "suite"
    if is_file(path / "results.parquet") and is_file(path / "sweep.yaml"):
        return "sweep"
    raise UserError(
        f"rayfl report {path}: not a run directory (summary.json), a suite folder "
        "(results.parquet + runs.parquet) or a sweep folder (results.parquet + sweep.yaml); "
        "pass a folder written by rayfl run --out, rayfl compare or rayfl tune"
    )


def write_report(path: str | Path, out: str | Path | None = None) -> Path:
    """Write the HTML page for folder `path` (default `<path>/report.html`); returns its path."""
    folder = Path(path)
    if not folder.is_dir():
        raise UserError(f"rayfl report {folder}: no such folder")
    kind = kind_of(folder)
    render = {"run": run_report, "suite": suite_report, "sweep": sweep_report}[kind]
    target = Path(out) if out else folder / "report.html"
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        page = render(folder)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        # a field of the right type but an unexpected shape (rayfl did not write it)
        raise UserError(
            f"rayfl report {folder}: a file there is malformed ({type(exc).__name__}: "
            f"{str(exc)[:80]}); restore it from the run, or rerun"
        ) from None
    write_atomic(target, page.encode("utf-8"))
    return target
