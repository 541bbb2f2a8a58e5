"""Table-driven checks over the WHOLE config schema: every field of every section and of every
registered algorithm's Params gets a value of the wrong type and, where it is a number, values out
of range; each must be refused with a ConfigError that names the dotted key."""

import dataclasses
import math
import types
import typing
from typing import Any, Literal

import pytest

from rayfl.algorithms import ALGORITHMS
from rayfl.config import RunConfig, build_config, parse_override
from rayfl.errors import ConfigError
from rayfl.schema import Range, range_of


def _leaf_types(tp: Any) -> list[Any]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(tp) if a is not type(None)]
    return [tp]


RANGES: dict[str, Range] = {}  # dotted key -> the range its `setting` declares


def _fields(cls: type, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, annotation) of every field, recursing into nested sections."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        key, tp = f"{prefix}{f.name}", hints[f.name]
        if key == "algorithm":
            continue  # covered per algorithm below
        if (rng := range_of(f)) is not None:
            RANGES[key] = rng
        nested = [t for t in _leaf_types(tp) if dataclasses.is_dataclass(t)]
        if nested:
            out.append((key, tp))
            out += _fields(nested[0], f"{key}.")
        else:
            out.append((key, tp))
    return out


def _wrong_type(tp: Any) -> str:
    """A YAML value no leaf type of `tp` accepts."""
    leaves = _leaf_types(tp)
    if any(
        dataclasses.is_dataclass(t) or typing.get_origin(t) is dict or t is dict for t in leaves
    ):
        return "5"
    if any(typing.get_origin(t) is tuple for t in leaves):
        return "abc" if any(t in (int, float) for t in leaves) else "5"  # int | tuple: 5 fits
    if any(t is str for t in leaves):
        return "[1, 2]"
    if any(typing.get_origin(t) is Literal for t in leaves):
        return "not_a_choice"
    return "abc"  # bool, int, float


def _numeric(tp: Any) -> Any:
    for t in _leaf_types(tp):
        if t in (int, float):
            return t
    return None


def _outside(key: str, kind: Any) -> list[str]:
    """Values out of range: negative, non-finite and just past the declared bounds."""
    values = ["-1", ".nan", ".inf"] if kind is float else ["-1"]
    rng = RANGES.get(key)
    if rng is not None:
        if rng.lo is not None and rng.lo > 0 or (rng.lo == 0 and rng.lo_open):
            values.append(
                repr(rng.lo) if rng.lo_open else repr(rng.lo - (1 if kind is int else 0.5))
            )
        if rng.hi is not None:
            values.append(
                repr(rng.hi) if rng.hi_open else repr(rng.hi + (1 if kind is int else 0.5))
            )
    return values


CORE = _fields(RunConfig)
CASES = []
for key, tp in CORE:
    CASES.append(pytest.param([f"{key}={_wrong_type(tp)}"], key, id=f"{key}:type"))
    kind = _numeric(tp)
    if kind is not None:
        for v in _outside(key, kind):
            CASES.append(pytest.param([f"{key}={v}"], key, id=f"{key}:{v}"))
for name, algo in ALGORITHMS.items():
    hints = typing.get_type_hints(algo.params)
    for f in dataclasses.fields(algo.params):
        key, tp = f"algorithm.{f.name}", hints[f.name]
        base = [f"algorithm.name={name}"]
        CASES.append(
            pytest.param(base + [f"{key}={_wrong_type(tp)}"], key, id=f"{name}.{f.name}:type")
        )
        kind = _numeric(tp)
        if kind is not None:
            for v in _outside(key, kind):
                CASES.append(pytest.param(base + [f"{key}={v}"], key, id=f"{name}.{f.name}:{v}"))


def test_the_table_covers_the_schema():
    keys = {k for k, _ in CORE}
    assert {"seed", "engine.round_timeout_s", "engine.max_retries", "data.partition.alpha"} <= keys
    assert {"engine.rounds", "engine.fraction", "data.test_fraction"} <= set(RANGES)
    assert RANGES["engine.rounds"].hi == 1_000_000
    assert len(CASES) > 150


@pytest.mark.parametrize(("overrides", "key"), CASES)
def test_every_field_refuses_wrong_types_and_out_of_range_values(synthetic_raw, overrides, key):
    with pytest.raises(ConfigError) as err:
        build_config(synthetic_raw, overrides)
    msg = str(err.value)
    assert key in msg and "\n" not in msg


@pytest.mark.parametrize(
    "override",
    ["seed=-1", "engine.round_timeout_s=-5", "engine.max_retries=-1", "engine.checkpoint_every=-1"],
)
def test_the_probed_negatives_are_refused(synthetic_raw, override):
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        build_config(synthetic_raw, [override])


def test_yaml_1_2_floats_are_numbers(synthetic_raw, tmp_path):
    assert parse_override("train.lr=1e-3")[1] == 0.001
    assert parse_override("train.lr=1E+2")[1] == 100.0
    assert parse_override("x=.5")[1] == 0.5 and parse_override("x=7")[1] == 7
    assert parse_override("name=1e3x")[1] == "1e3x"
    assert math.isnan(parse_override("x=.nan")[1])
    cfg = build_config(synthetic_raw, ["train.lr=1e-3", "algorithm.alpha=5e-1"])
    assert cfg.train.lr == 0.001 and cfg.algorithm.params.alpha == 0.5
    from rayfl.config import load_config

    path = tmp_path / "e.yaml"
    import yaml

    raw = dict(synthetic_raw)
    path.write_text(yaml.safe_dump(raw).replace("lr: 0.05", "lr: 5e-2"))
    assert "5e-2" in path.read_text() and load_config(path).train.lr == 0.05


def test_a_directory_is_reported_as_a_directory(tmp_path):
    from rayfl.config import load_config

    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def _sections(cls: type, prefix: str = "") -> list[tuple[str, type]]:
    out = [(prefix.rstrip("."), cls)]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        for t in _leaf_types(hints[f.name]):
            inner = typing.get_args(t)[-1] if typing.get_origin(t) in (tuple, dict) else t
            if dataclasses.is_dataclass(inner) and f.name != "algorithm":
                out += _sections(inner, f"{prefix}{f.name}.")
    return out


def test_every_key_has_one_line_of_help_in_the_schema():
    from rayfl.schema import help_of

    missing = [
        f"{name or 'top'}.{f.name}"
        for name, cls in _sections(RunConfig)
        for f in dataclasses.fields(cls)
        if f.name != "algorithm" and not help_of(f)
    ]
    missing += [
        f"{name}.{f.name}"
        for name, algo in ALGORITHMS.items()
        for f in dataclasses.fields(algo.params)
        if not help_of(f)
    ]
    assert missing == []
    helps = [help_of(f) for _, cls in _sections(RunConfig) for f in dataclasses.fields(cls)]
    assert all("\n" not in h for h in helps)


def test_ls_prints_the_help_declared_in_the_schema():
    # the help comes from the field's metadata: a field declared with `setting` and no comment
    from rayfl.describe import describe, describe_fields
    from rayfl.schema import setting

    @dataclasses.dataclass(frozen=True)
    class Demo:
        rate: float = setting(0.5, "how fast it goes", gt=0)
        plain: int = 3

    lines = describe_fields(Demo, "demo.")
    assert lines[0].split() == ["demo.rate", "0.5", "float", "how", "fast", "it", "goes"]
    assert lines[1].split() == ["demo.plain", "3", "int"]
    text = describe("engine")
    assert "engine.rounds" in text and "rounds of the federation" in text
    assert "algorithm.mu" in describe("fedprox") and "proximal weight" in describe("fedprox")


def test_declared_ranges_are_checked_on_any_section(synthetic_raw):
    with pytest.raises(ConfigError, match=r"devices.tiers\[0\].speed: must be > 0"):
        build_config(synthetic_raw, ["devices.tiers=[{name: a, speed: 0}]"])
    with pytest.raises(ConfigError, match=r"devices.tiers\[0\].availability: must be in \[0, 1\]"):
        build_config(synthetic_raw, ["devices.tiers=[{name: a, availability: 2}]"])
