"""`rayfl ls [NAME]`: what is registered, or an algorithm's (or a config section's) keys,
defaults and one line of help each.

The help of a key is its field's metadata, declared with `rayfl.schema.setting` (the config
sections and the algorithms' `Params` alike), so the schema is the one place that documents it.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap
import typing
from typing import Any

from rayfl.schema import RunConfig, help_of
from rayfl.tables import text_table


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
    return text or re.sub(r"\b(?:\w+\.)+(\w+)", r"\1", str(tp))  # typing.X, rayfl.schema.X


def describe_fields(cls: type, prefix: str) -> list[str]:
    """One line per field of dataclass `cls`: dotted key, default, type, help."""
    hints = typing.get_type_hints(cls)
    rows = [
        (f"{prefix}{f.name}", _show(_default(f)), _type_text(hints[f.name]), help_of(f))
        for f in dataclasses.fields(cls)
    ]
    return text_table(rows[0], rows[1:]) if rows else ["  (no parameters)"]


def describe(name: str) -> str:
    """The keys of algorithm `name`, or of config section `name` (engine, train, data, ...)."""
    from rayfl.algorithms import ALGORITHMS  # torch: only for an algorithm's keys

    sections = {f.name for f in dataclasses.fields(RunConfig)} - {"algorithm", "name", "seed"}
    if name in sections:
        hints = typing.get_type_hints(RunConfig)
        cls = hints[name]
        doc = (inspect.getdoc(cls) or "").split("\n\n")[0]  # every section has one
        head = f"{name}: {' '.join(doc.split())}"
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


def listing(name: str | None) -> str:
    """`rayfl ls [NAME]`: what is registered (NAME: one kind of it), or NAME's keys."""
    from rayfl.algorithms import ALGORITHMS
    from rayfl.data import DATASETS, PARTITIONERS
    from rayfl.models import FAMILIES, MODELS

    if name == "partitioners":
        return _partitioners_text()
    kinds = {
        "algorithms": [f"  {n:12s} {algo.summary}" for n, algo in ALGORITHMS.items()],
        "models": ["  " + ", ".join(MODELS.names())],
        "families": [f"  {n:14s} {', '.join(fam.architectures)}" for n, fam in FAMILIES.items()],
        "datasets": ["  " + ", ".join(DATASETS.names())],
    }
    if name in kinds:
        return "\n".join([f"{name}:", *kinds[name]])
    if name is not None:
        return describe(name)
    lines = [line for kind, rows in kinds.items() for line in (f"{kind}:", *rows)]
    lines += [
        "partitioners: " + ", ".join(PARTITIONERS.names()),
        "feature shift: data.domains (`rayfl ls partitioners` lists its transformations)",
        "`rayfl ls NAME` shows an algorithm's keys (or a section's: engine, train, data, ...)",
    ]
    return "\n".join(lines)


def _partitioners_text() -> str:
    """`rayfl ls partitioners`: label partitioners and the feature-shift options, one line each."""
    from rayfl.data import PARTITIONERS, transforms

    lines = ["label partitioners (data.partition.name):"]
    for name, fn in PARTITIONERS.items():
        lines.append(f"  {name:14s} {(inspect.getdoc(fn) or '').splitlines()[0]}")
    lines += [
        "feature shift (data.domains; composes with any label partitioner):",
        "  noise: X           NIID-Bench feature skew: client i gets Gaussian noise, std X*i/N",
        "  held_out: RECIPE   that domain's clients are only evaluated (domain generalization)",
        "  clients_per_domain, proportions: how many clients each domain gets (default: equal)",
        "domains (data.domains.transforms: one domain per recipe; `folder` datasets bring theirs):",
        *transforms.describe(),
    ]
    return "\n".join(lines)
