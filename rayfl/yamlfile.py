"""YAML parsed safely and within bounds: no Python objects, YAML 1.2 numbers, a nesting depth
refused before it is composed, and aliases whose expansion is bounded. Every YAML file rayfl
reads (experiments, suites, sweeps, a run's saved config) goes through `yaml_load`."""

from __future__ import annotations

import re
from typing import Any

import yaml

YAML_DEPTH = 100  # nesting of a config's values; a recursive alias nests without end
YAML_VALUES = 100_000  # values after aliases are expanded (a "billion laughs" file has 10^9)


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2 floats (`1e-3` and `1E5` are numbers, not strings)
    that refuses to compose nodes nested deeper than `YAML_DEPTH`, before any recursion the
    nesting would drive (composing, constructing, walking) can exhaust the stack."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self._depth >= YAML_DEPTH:
            raise yaml.YAMLError(
                f"nests deeper than {YAML_DEPTH} levels (line "
                f"{self.peek_event().start_mark.line + 1}); write it with less nesting"
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def yaml_load(text: str) -> Any:
    """Parse YAML text safely (no Python objects), with YAML 1.2 number syntax.

    Raises:
        yaml.YAMLError: also for nesting deeper than ``YAML_DEPTH`` (before composing it), a
            recursive alias or aliases that expand beyond ``YAML_VALUES`` values.
    """
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
    except ValueError as exc:  # an int of more digits than Python converts (`int` refuses)
        raise yaml.YAMLError(str(exc).splitlines()[0]) from None
    _check_expansion(data)
    return data


def _check_expansion(data: Any) -> None:
    budget = YAML_VALUES
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        node, depth = stack.pop()
        budget -= 1
        if depth > YAML_DEPTH or budget < 0:
            raise yaml.YAMLError(
                f"nests deeper than {YAML_DEPTH} levels or expands to over {YAML_VALUES} values "
                "(a recursive or repeated alias); write the values out"
            )
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
            stack.extend((k, depth + 1) for k in node if isinstance(k, tuple))
        elif isinstance(node, list | tuple):
            stack.extend((v, depth + 1) for v in node)
