"""The sweep file: its schema (`Sweep`, `TuneSettings`), loading and validation, and the Tune
search space it maps to. Imports no Ray at module level (`rayfl validate` loads sweeps)."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from rayfl.config import (
    apply_overrides,
    build_config,
    from_dict,
    parse_override,
    read_yaml,
    resolve_base_file,
    set_dotted,
)
from rayfl.errors import ConfigError, check_name, require, suggest
from rayfl.schema import RunConfig

log = logging.getLogger(__name__)


SPEC_KINDS = ("grid", "choice", "uniform", "loguniform", "randint")
VAL_METRIC = "personal/val_acc"  # what trials are ranked on unless tune.metric names another
TEST_METRIC = "personal/acc"  # reported beside it for the chosen trial, never ranked on
SWEEP_KEYS = ("sweep", "base", "description", "overrides", "space", "tune")


@dataclass(frozen=True)
class TuneSettings:
    """The `tune:` section of a sweep file."""

    # the per-round metric whose last value ranks trials; empty: personal/val_acc, on the
    # clients' validation splits (data.val_fraction); a test metric ranks on test data (warned)
    metric: str = ""
    mode: Literal["max", "min"] = "max"
    num_samples: int = 1  # repeats of the grid; each repeat draws the random distributions anew
    scheduler: Literal["asha"] | None = None  # asha: stop poor trials early, by round
    max_concurrent: int = 2  # trials running at once (placement groups also limit it)
    grace_period: int = 1  # asha: rounds every trial runs before it can be stopped
    reduction_factor: float = 2.0  # asha: keep the best 1/reduction_factor at each rung
    trial_cpus: float = 0.5  # the trial's own process with engine.executor=ray (it mostly waits)
    seed: int | None = 0  # random search draws are reproducible for a given seed (None: not)
    resume: bool = False  # continue the Tune experiment already in <out>/tune
    verbose: int = 1  # Tune's console output: 0 silent, 1 status updates, 2 every result
    # where Tune keeps the experiment (trial state, checkpoints): a path or a URI such as
    # s3://bucket/rayfl-sweeps that every node reaches (None: <out>/tune on the driver's node)
    storage: str | None = None


@dataclass(frozen=True)
class Sweep:
    """A validated sweep: the base experiment, its overrides, the search space and Tune settings."""

    name: str  # the Tune experiment and the MLflow parent run
    path: Path  # the sweep file
    base: Path  # the resolved base experiment file
    raw: dict[str, Any]  # the base experiment file as a nested dict (before overrides)
    overrides: tuple[str, ...]  # the sweep file's overrides, then the command line's
    space: dict[str, dict[str, Any]]  # dotted config key -> {kind: args}
    tune: TuneSettings
    config: RunConfig  # the base experiment with all overrides, validated
    description: str = ""

    def config_for(self, values: Mapping[str, Any]) -> RunConfig:
        """One trial's experiment: the base config with `values` (dotted key -> value) set; they
        win over overrides of the same key. A ConfigError when a value is invalid."""
        values = {k: _native(v) for k, v in values.items()}
        raw = apply_overrides(self.raw, [])
        overrides = [o for o in self.overrides if _override_key(o) not in values]
        for key, value in values.items():
            set_dotted(raw, key.split("."), value, f"space.{key}")
        if "algorithm.name" in values:
            # build_config drops the file's settings of another algorithm only when the name
            # arrives as an override, so a swept algorithm name is passed that way too.
            overrides.append(f"algorithm.name={values['algorithm.name']}")
        return build_config(raw, overrides)

    def fingerprint(self) -> dict[str, Any]:
        """What must not change between a sweep and its resumption."""
        settings = dataclasses.asdict(self.tune)
        for key in ("resume", "verbose", "max_concurrent", "storage"):
            settings.pop(key)
        return {
            "name": self.name,
            "base": str(self.base),
            "overrides": list(self.overrides),
            "space": self.space,
            "tune": settings,
        }


def _native(value: Any) -> Any:
    """numpy scalars (Tune's random draws) -> Python scalars, so configs and YAML accept them."""
    if isinstance(value, np.generic):
        return value.item()
    return value


def _override_key(text: str) -> str:
    return text.split("=", 1)[0].strip()


def split_overrides(overrides: Sequence[str]) -> tuple[list[str], dict[str, Any], list[str]]:
    """Route command-line overrides: (`tune.*` overrides, `space.*` entries, base overrides).

    Example:
        >>> split_overrides(["tune.num_samples=4", "space.seed={grid: [0, 1]}", "engine.rounds=3"])
        (['num_samples=4'], {'seed': {'grid': [0, 1]}}, ['engine.rounds=3'])
    """
    tune_ov: list[str] = []
    space_ov: dict[str, Any] = {}
    base_ov: list[str] = []
    for text in overrides:
        key = _override_key(text)
        if key.startswith("tune."):
            tune_ov.append(text.split(".", 1)[1])
        elif key.startswith("space."):
            _, value = parse_override(text)
            space_ov[key[len("space.") :]] = value
        else:
            base_ov.append(text)
    return tune_ov, space_ov, base_ov


def _check_spec(key: str, spec: Any) -> dict[str, Any]:
    """Check one space entry's shape; returns it as a plain `{kind: args}` dict."""
    where = f"space.{key}"
    if not isinstance(spec, Mapping) or len(spec) != 1:
        raise ConfigError(
            f"{where}: write one distribution, e.g. {{grid: [1, 2]}} ({', '.join(SPEC_KINDS)})"
        )
    kind, args = next(iter(spec.items()))
    if kind not in SPEC_KINDS:
        raise ConfigError(
            f"{where}: unknown distribution {kind!r}{suggest(str(kind), SPEC_KINDS)}; choose one of {', '.join(SPEC_KINDS)}"
        )
    if kind in ("grid", "choice"):
        require(
            isinstance(args, list) and len(args) > 0,
            where,
            f"{kind} needs a non-empty list of values",
        )
    else:
        ok = (
            isinstance(args, list)
            and len(args) == 2
            and all(isinstance(a, int | float) and not isinstance(a, bool) for a in args)
        )
        require(ok, where, f"{kind} needs [low, high] numbers")
        lo, hi = args
        require(lo < hi, where, f"{kind} needs low < high (got {lo}, {hi})")
        if kind == "loguniform":
            require(lo > 0, where, f"loguniform needs low > 0 (got {lo})")
        if kind == "randint":
            require(
                isinstance(lo, int) and isinstance(hi, int), where, "randint needs integer bounds"
            )
    return {str(kind): list(args)}


def _probe_values(spec: dict[str, Any]) -> list[Any]:
    """Values that stand for a distribution when checking it against the config schema."""
    kind, args = next(iter(spec.items()))
    if kind in ("grid", "choice"):
        return list(args)
    lo, hi = args
    if kind == "randint":
        return [lo, hi]
    # Draws between the bounds are fractional: an integer key such as algorithm.embed_dim must
    # refuse a fractional probe here, not in the middle of the sweep.
    half = math.floor(lo) + 0.5
    return [lo, hi, half if lo < half < hi else (lo + hi) / 2]


def load_sweep(path: str | Path, overrides: Sequence[str] = ()) -> Sweep:
    """Load and validate a sweep file (with `tune.*=`, `space.<key>=` and base `key=value`
    overrides, see the module doc) without running anything. Every space key is checked by
    building the base experiment with each probe value of its distribution; a ConfigError names
    an unknown or invalid key or value (`space.<key>: ...`)."""
    path = Path(path)
    doc = read_yaml(path, "sweep file")
    for key in doc:
        if key not in SWEEP_KEYS:
            raise ConfigError(
                f"{path}: unknown key {key}{suggest(str(key), SWEEP_KEYS)}; valid keys: {', '.join(SWEEP_KEYS)}"
            )
    name = doc.get("sweep")
    check_name(name, f"{path}: sweep")
    assert isinstance(name, str)
    tune_ov, space_ov, base_ov = split_overrides(overrides)

    tune_raw = apply_overrides(dict(doc.get("tune") or {}), tune_ov)
    settings = from_dict(TuneSettings, tune_raw, prefix="tune.")
    _check_settings(settings)

    file_overrides = doc.get("overrides") or []
    if not isinstance(file_overrides, list) or not all(isinstance(o, str) for o in file_overrides):
        raise ConfigError(
            f"{path}: overrides: write a list of key=value strings (e.g. [engine.rounds=3])"
        )
    space_doc = doc.get("space") or {}
    if not isinstance(space_doc, Mapping):
        raise ConfigError(
            f"{path}: space: map dotted config keys to distributions (e.g. algorithm.T: {{grid: [2, 4]}})"
        )
    space_raw = {**space_doc, **space_ov}
    if not space_raw:
        raise ConfigError(
            f"{path}: space: is empty; sweep at least one key (e.g. algorithm.T: {{grid: [2, 4]}})"
        )
    space = {str(k): _check_spec(str(k), v) for k, v in space_raw.items()}

    base = resolve_base_file(doc.get("base"), path)
    raw = read_yaml(base, "base experiment")
    all_overrides = tuple(file_overrides) + tuple(base_ov)
    config = build_config(raw, all_overrides)
    sweep = Sweep(
        name=name,
        path=path.resolve(),
        base=base,
        raw=raw,
        overrides=all_overrides,
        space=space,
        tune=settings,
        config=config,
        description=str(doc.get("description") or ""),
    )
    for key, spec in space.items():
        for value in _probe_values(spec):
            try:
                sweep.config_for({key: value})
            except ConfigError as exc:
                raise ConfigError(f"space.{key}: {exc}") from None
    from rayfl.checks import check_family

    check_family(config)
    return replace(sweep, tune=replace(settings, metric=ranking_metric(settings.metric, config)))


def is_validation_metric(metric: str) -> bool:
    """Whether `metric` is measured on validation data (`personal/val_acc`, `global/val_loss`)."""
    return metric.rsplit("/", 1)[-1].startswith("val_")


def ranking_metric(metric: str, config: RunConfig) -> str:
    """The metric trials are ranked on: validation accuracy by default. Without a validation
    split (`data.val_fraction` 0) a default or validation metric is refused in one line; a test
    metric named explicitly is allowed, with a warning: a winner chosen on test data has an
    optimistic test score."""
    has_val = config.data.val_fraction > 0
    if not metric or is_validation_metric(metric):
        require(
            has_val,
            "tune.metric",
            f"trials are ranked on validation data ({metric or VAL_METRIC}) but "
            "data.val_fraction is 0: set data.val_fraction (e.g. 0.1), or name a test metric "
            "(tune.metric=personal/acc) to rank on test data",
        )
        return metric or VAL_METRIC
    log.warning(
        "tune.metric=%s ranks trials on test data: the winner's test score is optimistically "
        "biased; set data.val_fraction and rank on %s instead",
        metric,
        VAL_METRIC,
    )
    return metric


def _check_settings(t: TuneSettings) -> None:
    checks = {
        "num_samples": (t.num_samples >= 1, "must be at least 1"),
        "max_concurrent": (t.max_concurrent >= 1, "must be at least 1"),
        "grace_period": (t.grace_period >= 1, "must be at least 1 round"),
        "reduction_factor": (t.reduction_factor > 1, "must be > 1"),
        "trial_cpus": (t.trial_cpus > 0, "must be > 0"),
    }
    for key, (ok, need) in checks.items():
        require(ok, f"tune.{key}", f"{need} (got {getattr(t, key)})")
    require(t.verbose in (0, 1, 2, 3), "tune.verbose", "must be 0, 1, 2 or 3")


def search_space(space: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Tune's `param_space` for the sweep's space (flat: dotted keys stay keys)."""
    from ray import tune

    kinds: dict[str, Any] = {
        "grid": lambda a: tune.grid_search(list(a)),
        "choice": lambda a: tune.choice(list(a)),
        "uniform": lambda a: tune.uniform(*a),
        "loguniform": lambda a: tune.loguniform(*a),
        "randint": lambda a: tune.randint(a[0], a[1] + 1),  # Tune's upper bound is exclusive
    }
    return {key: kinds[kind](args) for key, spec in space.items() for kind, args in spec.items()}


def num_trials(sweep: Sweep) -> int:
    """How many trials the sweep starts: grid sizes multiplied, times `tune.num_samples`."""
    grid = math.prod(len(s["grid"]) for s in sweep.space.values() if "grid" in s)
    return grid * sweep.tune.num_samples
