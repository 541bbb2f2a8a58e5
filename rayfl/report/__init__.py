"""`rayfl report DIR`: one self-contained HTML page (inline CSS, figures as base64 PNG) for a
run directory (`summary.json`), a suite folder (`runs.parquet`, `suite.yaml`) or a sweep folder
(`results.parquet` + `sweep.yaml`): the final metrics or comparison table, per-architecture and
per-domain accuracy, learning curves, the runs or trials with their status, the config.

Every file is read through :mod:`rayfl.gate` (authenticated, or with ``--untrusted`` only
bounded); the page draws at most ``MAX_DRAWN`` metrics and architectures and lists at most
``MAX_ROWS`` rows per table, saying what it left out; every string is escaped and every link is
a relative path inside the folder.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from rayfl import gate
from rayfl.errors import UserError
from rayfl.report.page import is_file, run_links
from rayfl.report.pages import run_report, suite_report, sweep_report

__all__ = ["run_links", "write_report"]


def kind_of(path: Path) -> str:
    """`run`, `suite` or `sweep`, from the files the folder holds."""
    names = ("summary.json", "runs.parquet", "suite.yaml", "results.parquet", "sweep.yaml")
    has = {n for n in names if is_file(path / n)}
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
