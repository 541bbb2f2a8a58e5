"""`rayfl ls NAME`: an algorithm's (or a config section's) keys, defaults and one line of help each.

The help of a field is `field(metadata={"help": ...})` when given, else the comment written beside
(or just above) the field in its dataclass, so the source stays the one place that documents it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import typing
from typing import Any


def field_help(cls: type) -> dict[str, str]:
    """Field name -> its help text, from metadata or the source comments of dataclass `cls`."""
    comments: dict[str, str] = {}
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        source = ""
    if source:
        notes: dict[int, str] = {}
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                notes[tok.start[0]] = tok.string.lstrip("#").strip()
        (node,) = ast.parse(source).body
        assert isinstance(node, ast.ClassDef)
        previous_end = node.lineno
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                end = stmt.end_lineno or stmt.lineno
                inline = [notes[i] for i in range(stmt.lineno, end + 1) if i in notes]
                above = [notes[i] for i in range(previous_end + 1, stmt.lineno) if i in notes]
                text = " ".join(inline or above)
                if text:
                    comments[stmt.target.id] = text
            previous_end = stmt.end_lineno or stmt.lineno
    out: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        text = f.metadata.get("help") or comments.get(f.name, "")
        out[f.name] = str(text)
    return out


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "(required)"


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        inner = ", ".join(
            f"{f.name}: {_show(getattr(value, f.name))}" for f in dataclasses.fields(value)
        )
        return "{" + inner + "}"
    if isinstance(value, tuple):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return str(value)


def _type_text(tp: Any) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return " | ".join(map(str, typing.get_args(tp)))
    text = getattr(tp, "__name__", None) if isinstance(tp, type) else None
    return text or str(tp).replace("typing.", "")


def describe_fields(cls: type, prefix: str) -> list[str]:
    """One line per field of dataclass `cls`: dotted key, default, type, help."""
    helps = field_help(cls)
    hints = typing.get_type_hints(cls)
    rows = [
        (f"{prefix}{f.name}", _show(_default(f)), _type_text(hints[f.name]), helps[f.name])
        for f in dataclasses.fields(cls)
    ]
    if not rows:
        return ["  (no parameters)"]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return [
        ("  " + "  ".join(r[i].ljust(widths[i]) for i in range(3)) + f"  {r[3]}").rstrip()
        for r in rows
    ]


def describe(name: str) -> str:
    """The keys of algorithm `name`, or of config section `name` (engine, train, data, ...)."""
    from rayfl.algorithms import ALGORITHMS
    from rayfl.schema import RunConfig

    sections = {f.name for f in dataclasses.fields(RunConfig)} - {"algorithm", "name", "seed"}
    if name in sections:
        hints = typing.get_type_hints(RunConfig)
        cls = hints[name]
        doc = (inspect.getdoc(cls) or "").split("\n\n")[0]
        generated = doc.startswith(f"{cls.__name__}(")  # dataclass's signature, not a docstring
        head = name if generated or not doc else f"{name}: {' '.join(doc.split())}"
        return "\n".join([head, *describe_fields(cls, f"{name}.")])
    algo = ALGORITHMS.get(name, key="rayfl ls")
    module = inspect.getmodule(algo.client)
    paragraph = (inspect.getdoc(module) or "").strip().split("\n\n")[0]
    lines = [f"{name}: {algo.summary}"]
    if paragraph:
        lines += textwrap.wrap(
            " ".join(paragraph.split()), 96, initial_indent="  ", subsequent_indent="  "
        )
    lines.append(
        "keys (in the YAML's algorithm section, or algorithm.KEY=VALUE on the command line):"
    )
    lines += describe_fields(algo.params, "algorithm.")
    return "\n".join(lines)
