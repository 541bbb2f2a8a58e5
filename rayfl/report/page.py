"""The building blocks of a report page: escaped tables, inlined figures, links that stay inside
the folder, and the page itself; every file read through :mod:`rayfl.gate`."""

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


def esc(value: Any) -> str:
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
    return Html(f'<a href="{esc(href)}">{esc(text)}</a>')


def capped(items: Sequence[Any], limit: int, what: str) -> tuple[list[Any], str]:
    """The first `limit` items, and a note saying how many were left out ('' if none)."""
    left = len(items) - limit
    note = f'<p class="note">{left} more {esc(what)} not shown</p>' if left > 0 else ""
    return list(items[:limit]), note


def _cell(value: Any) -> str:
    if isinstance(value, Html):
        return f"<td>{value}</td>"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f'<td class="num">{esc(_fmt(value))}</td>'
    return f"<td>{esc(value)}</td>"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], classes: Sequence[str] = ()) -> str:
    """An HTML table; numbers right-aligned, `Html` cells as they are, `classes[i]` on row i."""
    header, note = capped(header, MAX_ROWS, "columns")
    rows, more = capped(rows, MAX_ROWS, "rows")
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
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
    return f'<img alt="{esc(alt)}" src="data:image/png;base64,{data}">'


def figure(draw: Callable[[Path], Any], alt: str) -> str:
    """Render a plot function into a temporary PNG and inline it."""
    with tempfile.TemporaryDirectory(prefix="rayfl-report-") as tmp:
        path = Path(tmp) / "figure.png"
        with gate.untrusted(False):  # a private temporary folder of this process
            draw(path)
        return image(path, alt)


def page(title: str, subtitle: str, sections: Sequence[tuple[str, str]]) -> str:
    body = "".join(f"<h2>{esc(h)}</h2>{content}" for h, content in sections if content)
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body>"
        f'<h1>{esc(title)}</h1><p class="sub">{esc(subtitle)}</p>{body}</body></html>'
    )


def read_history(path: Path) -> list[dict[str, Any]]:
    """A run's metrics.parquet: rows of numbers ({} cells dropped where they are not)."""
    return [
        {k: v for k, v in row.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        for row in read_table(path)
    ]


def is_file(path: Path) -> bool:
    """Whether ``path`` is a regular file; a link or special file there is refused."""
    with gate.Folder(path.parent) as folder:
        kind = folder.kind(path.name)
    if kind not in (None, "file"):
        what = "symbolic link" if kind == "link" else kind
        raise gate.refuse(path, f"is a {what}, not a regular file")
    return kind == "file"


def arch_bars(groups: Mapping[str, Mapping[str, float]], **options: Any) -> Callable[[Path], Any]:
    """Bars of personalized accuracy per category (`plot_bars`), to draw into a `figure`."""
    from rayfl.tracking.plots import plot_bars

    return partial(plot_bars, groups, ylabel="personalized accuracy", **options)


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
        return text or parts[-1], esc(mlflow_id) or "-"
    target = [*parts, "report.html"] if page else list(parts)
    return link(target, text or parts[-1]), Html(esc(mlflow_id)) if mlflow_id else "-"
