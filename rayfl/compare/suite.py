"""Loading a comparison suite: the suite file, its selectors and every run's validated config."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from itertools import product
from pathlib import Path
from typing import Any, NamedTuple

from rayfl.config import build_config, parse_override, read_yaml, resolve_base_file, set_dotted
from rayfl.errors import ConfigError, UserError, check_name, suggest
from rayfl.schema import RunConfig

SUITE_KEYS = tuple(
    ["suite", "base", "base_file", "algorithms", "seeds", "settings", "description", "parallel"]
)
SELECT_KEYS = ("seeds", "algorithms", "settings")  # suite-level command-line overrides


class SuiteRun(NamedTuple):
    """One run of a suite: the algorithm's label, the seed, the full config, the setting's name."""

    label: str
    seed: int
    config: RunConfig
    setting: str = ""


@dataclasses.dataclass(frozen=True)
class Suite:
    """A loaded, validated suite: every run's config is built and checked."""

    name: str
    runs: list[SuiteRun]
    labels: list[str]
    seeds: list[int]
    settings: list[str]  # [""] when the suite has no settings
    algorithms: dict[str, str]  # label -> algorithm name
    parallel: int = 1  # runs at a time (each reserving its workers through a placement group)


def _pairs(overrides: Any, key: str) -> list[tuple[list[str], Any]]:
    """Overrides given as {dotted: value} or ["dotted=value", ...] as (path, value) pairs."""
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        return [(str(k).split("."), v) for k, v in overrides.items()]
    if isinstance(overrides, list) and all(isinstance(o, str) for o in overrides):
        return [parse_override(o) for o in overrides]
    raise ConfigError(f"{key}: expected a mapping of dotted keys or a list of key=value strings")


def _base(raw: Mapping[str, Any], path: Path) -> dict[str, Any]:
    if ("base" in raw) == ("base_file" in raw):
        raise ConfigError(
            f"{path}: give exactly one of base (a run config) or base_file (a path to one)"
        )
    if "base" in raw:
        if not isinstance(raw["base"], dict):
            raise ConfigError(f"{path}: base must be a mapping (a run config without algorithm)")
        return copy.deepcopy(raw["base"])
    return read_yaml(resolve_base_file(raw["base_file"], path, "base_file"), "base_file")


def _split_cli(overrides: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    select: dict[str, Any] = {}
    rest: list[str] = []
    for text in overrides:
        keypath, value = parse_override(text)
        if keypath == ["parallel"]:
            select["parallel"] = value
        elif len(keypath) == 1 and keypath[0] in SELECT_KEYS:
            if not isinstance(value, list):
                raise ConfigError(
                    f"override {text!r}: {keypath[0]} takes a list, e.g. {keypath[0]}=[a,b]"
                )
            select[keypath[0]] = value
        elif keypath == ["seed"]:
            raise ConfigError(f"override {text!r}: a suite runs several seeds; use seeds=[0,1]")
        else:
            rest.append(text)
    return select, rest


def _pick(items: list[Any], names: list[str], wanted: Any, key: str) -> list[Any]:
    if wanted is None:
        return items
    unknown = [w for w in wanted if str(w) not in names]
    if unknown:
        raise ConfigError(
            f"{key}: {unknown[0]!r} is not in this suite{suggest(str(unknown[0]), names)}; "
            f"choose from {', '.join(names)}"
        )
    return [item for item, name in zip(items, names) if name in {str(w) for w in wanted}]


Overrides = list[tuple[list[str], Any]]


def _algorithm_entries(raw: Mapping[str, Any], path: Path) -> tuple[list[Any], list[str]]:
    """`(label, algorithm name, override pairs)` per entry of `algorithms`, and the labels."""
    entries = raw.get("algorithms")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(
            f"{path}: algorithms must be a non-empty list of {{name, label?, overrides?}}"
        )
    algos: list[tuple[str, str, Overrides]] = []
    for i, entry in enumerate(entries):
        key = f"algorithms[{i}]"
        if isinstance(entry, str):
            entry = {"name": entry}
        if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
            raise ConfigError(f"{key}: needs a name (e.g. {{name: fedproto}})")
        extra = set(entry) - {"name", "label", "overrides"}
        if extra:
            raise ConfigError(
                f"{key}: unknown key {sorted(extra)[0]!r}; valid keys: name, label, overrides"
            )
        label = str(entry.get("label") or entry["name"])
        pairs = _pairs(entry.get("overrides"), f"{key}.overrides")
        for keypath, _ in pairs:
            if keypath[0] in ("data", "seed"):
                raise ConfigError(
                    f"{key}.overrides: {'.'.join(keypath)} would give {label} a different partition "
                    "than the other algorithms; set it in base or in a setting"
                )
        algos.append((label, entry["name"], pairs))
    labels = [a[0] for a in algos]
    for i, label in enumerate(labels):
        check_name(label, f"{path}: algorithms[{i}].label")
        if labels.count(label) > 1:
            raise ConfigError(
                f"{path}: algorithm label {label!r} is repeated; give each a unique label"
            )
    return algos, labels


def _seeds(seeds: Any, path: Path) -> list[int]:
    if not isinstance(seeds, list) or not seeds or not all(type(s) is int for s in seeds):
        raise ConfigError(f"{path}: seeds must be a non-empty list of integers, e.g. [0, 1, 2]")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"{path}: seeds {seeds} repeat a seed")
    return [int(s) for s in seeds]


def _settings(raw: Mapping[str, Any], path: Path) -> tuple[list[Any], list[str]]:
    """`(name, override pairs)` per setting (one unnamed setting when there are none), and names."""
    settings_raw = raw.get("settings") or [{"name": "", "overrides": {}}]
    if not isinstance(settings_raw, list):
        raise ConfigError(f"{path}: settings must be a list of {{name, overrides}}")
    settings: list[tuple[str, Overrides]] = []
    allowed = {"name", "overrides"}
    for i, s in enumerate(settings_raw):
        if not isinstance(s, Mapping) or not isinstance(s.get("name"), str) or set(s) - allowed:
            raise ConfigError(f"settings[{i}]: expected {{name, overrides}}")
        if raw.get("settings"):  # (not the one unnamed setting)
            check_name(s["name"], f"settings[{i}].name")
        if any(s["name"] == other[0] for other in settings):
            raise ConfigError(f"settings[{i}]: name {s['name']!r} is repeated")
        pairs = _pairs(s.get("overrides"), f"settings[{i}].overrides")
        if any(p == ["seed"] for p, _ in pairs):
            raise ConfigError(f"settings[{i}].overrides: use the suite's seeds, not seed")
        settings.append((s["name"], pairs))
    return settings, [s[0] for s in settings]


def load_suite(path: str | Path, overrides: Sequence[str] = ()) -> Suite:
    """Read a suite file, build and validate every run's config. `overrides` are `key=value`
    strings applied to every run, plus the selectors `seeds=[...]`, `algorithms=[labels]`,
    `settings=[names]` and `parallel=N`. A ConfigError names what is malformed or invalid."""
    from rayfl.checks import check_family

    path = Path(path)
    raw = read_yaml(path, "suite file")
    unknown = [k for k in raw if k not in SUITE_KEYS]
    if unknown:
        raise ConfigError(
            f"{path}: unknown suite key {unknown[0]!r}{suggest(str(unknown[0]), SUITE_KEYS)}; "
            f"valid keys: {', '.join(SUITE_KEYS)}"
        )
    name = raw.get("suite")
    check_name(name, f"{path}: suite")
    assert isinstance(name, str)
    base = _base(raw, path)
    base_algorithm = base.pop("algorithm", None) or {}
    select, cli = _split_cli(overrides)

    algos = _pick(*_algorithm_entries(raw, path), select.get("algorithms"), "algorithms")
    seeds = _seeds(select.get("seeds", raw.get("seeds", [0])), path)
    settings = _pick(*_settings(raw, path), select.get("settings"), "settings")

    runs: list[SuiteRun] = []
    base_algo = base_algorithm.get("name") if isinstance(base_algorithm, Mapping) else None
    for (setting, s_pairs), (label, algo, a_pairs), seed in product(settings, algos, seeds):
        run_raw = copy.deepcopy(base)
        run_raw["algorithm"] = dict(base_algorithm) if base_algo == algo else {"name": algo}
        for keypath, value in [*s_pairs, *a_pairs]:
            set_dotted(run_raw, keypath, copy.deepcopy(value), label)
        try:
            cfg = build_config(run_raw, cli)
            tracking = dataclasses.replace(cfg.tracking, run_name=run_name(setting, label, seed))
            cfg = dataclasses.replace(cfg, name=name, seed=seed, tracking=tracking)
            check_family(cfg)
        except UserError as exc:
            where = f"{setting + ' / ' if setting else ''}{label}: "
            raise type(exc)(f"{path}: {where}{exc}") from None
        runs.append(SuiteRun(label, seed, cfg, setting))
    parallel = select.get("parallel", raw.get("parallel", 1))
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise ConfigError(
            f"{path}: parallel must be a whole number >= 1 (runs at a time), got {parallel!r}"
        )
    return Suite(
        name=name,
        runs=runs,
        labels=[a[0] for a in algos],
        seeds=seeds,
        settings=[s[0] for s in settings],
        algorithms={a[0]: a[1] for a in algos},
        parallel=parallel,
    )


def run_name(setting: str, label: str, seed: int) -> str:
    return f"{setting + '-' if setting else ''}{label}-s{seed}"
