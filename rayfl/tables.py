"""The one writer of result tables (rows of a run's metrics, a suite's runs, a sweep's trials).

Rows are dicts; a column is every key seen in any row (first-seen order unless a `key` orders
them), missing cells are nulls, and a column that mixes types (a grid of names and numbers) is
written as text. Files are written to a temporary sibling and renamed into place, so a reader
never sees half a table. JSON files are written strictly (`strict_json`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rayfl import gate
from rayfl.gate import write_with

MAX_ROWS, MAX_COLUMNS = 2_000_000, 20_000  # a table read back, checked from its footer


def columns(rows: Sequence[Mapping[str, Any]], key: Callable[[str], Any] | None = None) -> Any:
    """The rows as a `pyarrow.Table` (see the module docstring for the column rules)."""
    import pyarrow as pa

    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row))
    ordered = sorted(names, key=key) if key is not None else list(names)
    data: dict[str, Any] = {}
    for name in ordered:
        values = [row.get(name) for row in rows]
        try:
            data[name] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            data[name] = pa.array([None if v is None else str(v) for v in values])
    return pa.table(data)


def write_table(
    rows: Sequence[Mapping[str, Any]],
    path: str | Path,
    *,
    csv: bool = False,
    key: Callable[[str], Any] | None = None,
) -> list[Path]:
    """Write `rows` to `path` (suffix `.parquet`), with `csv=True` also a CSV twin (suites, for
    spreadsheets); `key` sorts the columns. Returns the files written, the CSV first."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    table = columns(rows, key)
    target = Path(path).with_suffix(".parquet")
    written = [target]
    write_with(target, lambda f: pq.write_table(table, f))
    if csv:
        twin = target.with_suffix(".csv")
        write_with(twin, lambda f: pacsv.write_csv(table, f))
        written.insert(0, twin)
    return written


def text_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    """Text cells as aligned lines, each indented by two spaces (the printed reports)."""
    rows = [list(header), *map(list, body)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def finite_or_none(obj: Any) -> Any:
    """A copy of nested dicts/lists with NaN and inf floats replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite_or_none(v) for v in obj]
    return obj


def strict_json(obj: Any, **kwargs: Any) -> str:
    """JSON that every parser accepts: NaN and inf become null (`allow_nan=False` holds)."""
    return json.dumps(finite_or_none(obj), allow_nan=False, default=str, **kwargs)


def read_table(path: str | Path, limit: int = gate.TABLE_LIMIT) -> list[dict[str, Any]]:
    """The rows of a Parquet table ([] when missing); its rows, columns and decoded size are
    checked from its footer before a column is decoded."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        data = gate.read(path, limit)
    except FileNotFoundError:
        return []
    try:
        meta = pq.ParquetFile(pa.BufferReader(data)).metadata
        size = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        if meta.num_rows > MAX_ROWS or meta.num_columns > MAX_COLUMNS or size > limit:
            raise gate.refuse(
                path,
                f"holds {meta.num_rows} rows x {meta.num_columns} columns ({size} bytes), over "
                f"the limits ({MAX_ROWS} rows, {MAX_COLUMNS} columns, {limit} bytes)",
            )
        rows: list[dict[str, Any]] = pq.read_table(pa.BufferReader(data)).to_pylist()
    except (pa.ArrowException, OSError, ValueError):
        raise gate.refuse(path, "is not a readable Parquet table") from None
    return rows
