"""Loading a run configuration: YAML within bounds, dotted `key=value` overrides, plugins, and
each key checked against the schema (`rayfl.schema`: type, range, pattern), then across keys
(`rayfl.checks`). The `algorithm` section holds `name` plus the fields of that algorithm's own
frozen `Params`. A problem is a one-line `ConfigError` naming the dotted key and the fix.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from rayfl import plugins
from rayfl.checks import check
from rayfl.errors import ConfigError, suggest
from rayfl.schema import (  # noqa: F401 (the schema's names, re-exported for callers)
    AlgorithmConfig,
    DataConfig,
    DevicesConfig,
    DomainsConfig,
    DPConfig,
    EngineConfig,
    EvalConfig,
    ModelConfig,
    PartitionConfig,
    PrivacyConfig,
    Resources,
    RunConfig,
    SecAggConfig,
    TierConfig,
    TrackingConfig,
    TrainConfig,
    clients_per_round,
    range_of,
    server_in_driver,
    to_dict,
)
from rayfl.yamlfile import yaml_load


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (['a', 'b', 'c'], value), the value parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not key=value (e.g. engine.rounds=5)")
    key, raw = text.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ConfigError(f"override {text!r} has an empty key part")
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return path, value


def set_dotted(raw: dict[str, Any], path: Sequence[str], value: Any, where: str) -> None:
    """Set `raw[a][b][c] = value` for `path` ['a', 'b', 'c'], creating sections; `where` names the
    source (an override, a suite entry) in the error when a part is a value, not a section."""
    node = raw
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"{where}: {'.'.join(path[: i + 1])} is a value, not a section")
        node = child
    node[path[-1]] = value


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of the nested dict `raw` with dotted overrides applied."""
    out = copy.deepcopy(raw)
    for text in overrides:
        path, value = parse_override(text)
        set_dotted(out, path, value, f"override {text!r}")
    return out


def read_yaml(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """A YAML file whose top level is a mapping, or a ConfigError naming the problem."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(
            f"{what} {path} is a directory; pass a YAML file (e.g. experiments/*.yaml)"
        )
    if not path.is_file():
        raise ConfigError(
            f"{what} {path} not found: check the path (examples live in experiments/)"
        )
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what} {path} cannot be read ({exc}); check the file") from None
    return parse_yaml(text, path)


def parse_yaml(text: str, path: Path) -> dict[str, Any]:
    """The YAML text of file ``path`` as a mapping, or a ConfigError naming the problem."""
    try:
        raw = yaml_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return plugins.absolute(raw, path.parent)  # `plugins:` paths are relative to the file


REPO_ROOT = Path(__file__).resolve().parents[1]


def resolve_base_file(name: Any, referrer: Path, key: str = "base") -> Path:
    """The experiment file a suite (`base_file:`) or a sweep (`base:`) builds on: a relative
    path is looked up next to the referring file, in the current directory, then in the
    repository root, so a suite or sweep works from wherever it is run."""
    if not isinstance(name, str) or not name:
        raise ConfigError(
            f"{referrer}: {key}: name the experiment file to build on (e.g. experiments/pfedes_fmnist.yaml)"
        )
    path = Path(name).expanduser()
    candidates = (
        [path]
        if path.is_absolute()
        else [referrer.parent / path, Path.cwd() / path, REPO_ROOT / path]
    )
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise ConfigError(
        f"{referrer}: {key}: {name} not found (looked in {', '.join(str(c.parent) for c in candidates)}); "
        "give a path relative to that file or to the repository root"
    )


def _options(tp: Any) -> list[str]:
    """The values a bool or Literal annotation allows, as a config writes them (else none)."""
    if tp is bool:
        return ["true", "false"]
    if typing.get_origin(tp) is Literal:
        return [str(a) for a in typing.get_args(tp)]
    return []


INT_CAP = 2**63  # every number fits 64 bits unless its field declares a wider range


def convert(value: Any, tp: Any, key: str, cap: int = INT_CAP) -> Any:
    """Check `value` against the annotation `tp` and convert it (lists to tuples, ints to floats);
    a number's magnitude stays below `cap`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return convert(value, arg, key, cap)
            except ConfigError as exc:
                errors.append(exc)
        options = [_options(a) for a in args if a is not type(None)]
        if all(options):  # e.g. `bool | Literal["auto"]`: one message naming every choice
            names = [o for opts in options for o in opts]
            raise ConfigError(
                f"{key}: {value!r} is not allowed{suggest(str(value), names)}; "
                f"choose one of {', '.join(names)}"
            )
        raise errors[0]
    if origin is Literal:
        if value not in args:
            raise ConfigError(
                f"{key}: {value!r} is not allowed{suggest(str(value), map(str, args))}; "
                f"choose one of {', '.join(map(str, args))}"
            )
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return from_dict(tp, value, prefix=f"{key}.")
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {value!r}; write it as [a, b, ...]")
        item_tp = args[0] if args else Any
        return tuple(convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        if len(args) == 2:  # dict[str, X]: every key a string, every value an X
            for k in value:
                if not isinstance(k, str):
                    raise ConfigError(f"{key}: keys must be names, got {k!r}")
            return {k: convert(v, args[1], f"{key}.{k}") for k, v in value.items()}
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
                return _number(int(value), key, cap)
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return _number(value, key, cap)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return _number(float(value), key, cap)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {tp} for {key}")


def _number(value: float, key: str, cap: int) -> Any:
    """Every number in the schema is finite and below `cap` (and is >= 0, see `from_dict`)."""
    if not math.isfinite(value):
        raise ConfigError(f"{key}: must be a finite number (got {value!r})")
    if abs(value) >= cap:
        raise ConfigError(f"{key}: must be below 2^{cap.bit_length() - 1} (got {float(value):g})")
    return value


def _cap(f: dataclasses.Field[Any]) -> int:
    """A field's bound on magnitude: 64 bits, or the wider upper end its range declares."""
    rng = range_of(f)
    if rng is not None and rng.hi is not None and rng.hi > INT_CAP:
        return int(rng.hi) + (0 if rng.hi_open else 1)
    return INT_CAP


# Settings that no longer exist, and why (docs/performance.md, "Engine options and what they cost")
REMOVED = {
    "engine.driver_trains": "the driver no longer trains beside the workers' actors; delete the "
    "key (engine.num_workers sets the workers)",
    "engine.lean_ray": "a private Ray now starts with Ray's supported options only; delete the key",
    "engine.grouped": "grouped (vectorized) client training was slower than the loop and is gone; "
    "delete the key",
}


def from_dict(cls: type, data: Any, prefix: str = "", given: Mapping[str, Any] = {}) -> Any:
    """Build dataclass `cls` from a mapping (plus the fields already built, `given`), refusing
    unknown keys, wrong types and negative numbers (declared ranges and the algorithms' checks
    narrow them further)."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if f"{prefix}{key}" in REMOVED:
            raise ConfigError(f"{prefix}{key} was removed: {REMOVED[f'{prefix}{key}']}")
        if key not in fields:
            valid = (
                f"valid keys under {prefix[:-1]}: {', '.join(fields)}"
                if prefix
                else f"valid top-level keys: {', '.join(sorted(fields))}"
            )
            raise ConfigError(f"unknown key {prefix}{key}{suggest(str(key), fields)}; {valid}")
    kwargs = {
        name: convert(data[name], hints[name], f"{prefix}{name}", _cap(fields[name]))
        for name in fields
        if name in data
    }
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs
        and n not in given
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"missing key {prefix}{missing[0]}: set it in the YAML file")
    for name, value in kwargs.items():
        _check_field(fields[name], value, f"{prefix}{name}")
    obj = cls(**given, **kwargs)  # a section's own checks (an algorithm's Params) speak first
    for name, value in kwargs.items():
        if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
            raise ConfigError(f"{prefix}{name}: must be >= 0 (got {value!r})")
    return obj


def _check_field(f: dataclasses.Field[Any], value: Any, key: str) -> None:
    """The range or pattern `setting` declared for the field (`rayfl.schema`)."""
    rng = range_of(f)
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if rng is not None and number and not rng.contains(value):
        raise ConfigError(f"{key}: {rng.describe()} (got {value})")
    pattern = f.metadata.get("pattern")
    if pattern is not None and isinstance(value, str) and not re.fullmatch(pattern, value):
        raise ConfigError(
            f"{key}: {value[:120]!r} is not a single name; use letters, digits, '.', '_' and '-' "
            "(at most 100, not starting with '.' or '-')"
        )


def _algorithm_from_dict(data: Any, explicit: set[str] | None) -> AlgorithmConfig:
    """The `algorithm` section. With `explicit` (the algorithm switched on the command line,
    and the keys the command line sets) the file's keys the new algorithm lacks are dropped;
    the command line's stay strict."""
    from rayfl.algorithms import ALGORITHMS

    if not isinstance(data, Mapping) or "name" not in data:
        raise ConfigError("missing key algorithm.name: name an algorithm (see `rayfl ls`)")
    data = dict(data)
    name = data.pop("name")
    if not isinstance(name, str):
        raise ConfigError(f"algorithm.name: expected a string, got {name!r}")
    algo = ALGORITHMS.get(name, key="algorithm.name")
    valid = {f.name for f in dataclasses.fields(algo.params)}
    if explicit is not None:
        data = {k: v for k, v in data.items() if k in valid}
    params = from_dict(algo.params, data, prefix="algorithm.")
    for key in (explicit or set()) - valid - {"name"}:
        raise ConfigError(
            f"unknown key algorithm.{key} for algorithm {name!r}{suggest(key, valid | {'name'})}; "
            f"valid keys: {', '.join(sorted(valid | {'name'}))}"
        )
    return AlgorithmConfig(name=name, params=params)


def build_config(raw: Mapping[str, Any], overrides: Sequence[str] = ()) -> RunConfig:
    """Validated `RunConfig` from a nested dict plus dotted overrides."""
    file_algorithm = dict(raw.get("algorithm") or {}) if isinstance(raw, Mapping) else {}
    # `plugins:` (rayfl.plugins) register names the rest of the config may use
    merged = plugins.take(apply_overrides(dict(raw), overrides))
    keys = [o.split("=", 1)[0].strip() for o in overrides]
    explicit = None
    if "algorithm.name" in keys and file_algorithm:
        explicit = {k[len("algorithm.") :] for k in keys if k.startswith("algorithm.")}
    algo_cfg = _algorithm_from_dict(merged.pop("algorithm", None), explicit)
    cfg: RunConfig = from_dict(RunConfig, merged, given={"algorithm": algo_cfg})
    check(cfg)
    return cfg


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Load a YAML experiment file and apply `key=value` overrides."""
    return build_config(read_yaml(path), overrides)
