"""Checking a config: the schema's types (`from_dict`, `convert`), ranges and cross-field rules
(`check`), and what can be known infeasible before any data is loaded or Ray started
(`check_feasible`): `rayfl validate` and `rayfl run` refuse the same configs, before the work.

The schema itself (the dataclasses and `RANGES`) lives in `rayfl.config`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from rayfl.errors import ConfigError, require, suggest

if TYPE_CHECKING:
    from rayfl.config import EngineConfig, RunConfig


# --------------------------------------------------------------------------- ranges


@dataclasses.dataclass(frozen=True)
class Range:
    """The allowed interval of a numeric setting; open ends exclude the bound."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def contains(self, v: float) -> bool:
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return not (self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi))

    def describe(self) -> str:
        if self.hi is None:
            return f"must be {'>' if self.lo_open else '>='} {shown(self.lo)}"
        left = "(" if self.lo_open else "["
        right = ")" if self.hi_open else "]"
        return f"must be in {left}{shown(self.lo)}, {shown(self.hi)}{right}"


def shown(value: Any) -> str:
    """A number for a message: whole numbers in full up to 15 digits, others in `g` form (an
    int of thousands of digits has no `str` in Python >= 3.11)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return repr(value)
    if isinstance(value, int):
        return str(value) if abs(value) < 10**15 else f"about 1e{value.bit_length() * 0.30103:.0f}"
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:g}"


AT_LEAST_1 = Range(lo=1)
POSITIVE = Range(lo=0, lo_open=True)

# Every number in the schema must be finite and >= 0 (checked while parsing, with the key in the
# message); these are the tighter ranges. A None value (where allowed) is never range-checked.
RANGES: dict[str, Range] = {
    "data.num_clients": AT_LEAST_1,
    "data.partition.alpha": POSITIVE,
    "data.partition.classes_per_client": AT_LEAST_1,
    "data.test_fraction": Range(lo=0, hi=1, lo_open=True, hi_open=True),
    "data.public_fraction": Range(lo=0, hi=1, hi_open=True),
    "data.train_samples": AT_LEAST_1,
    "data.val_fraction": Range(lo=0, hi=1, hi_open=True),
    "train.local_epochs": Range(lo=0, hi=10_000),
    "train.batch_size": AT_LEAST_1,
    "train.lr": POSITIVE,
    "train.momentum": Range(lo=0, hi=1),
    "train.grad_clip": POSITIVE,
    "train.eval_batch_size": AT_LEAST_1,
    "engine.rounds": AT_LEAST_1,
    "engine.fraction": Range(lo=0, hi=1, lo_open=True),
    "engine.clients_per_round": AT_LEAST_1,
    "engine.num_workers": Range(lo=1, hi=10_000),
    "engine.ray_num_cpus": AT_LEAST_1,
    "engine.object_store_mb": Range(lo=80),
    "engine.eval_every": AT_LEAST_1,
    "engine.clients_per_call": AT_LEAST_1,
    "engine.num_threads": AT_LEAST_1,
    "engine.server_threads": AT_LEAST_1,
    "engine.round_timeout_s": POSITIVE,
    "engine.min_replies": AT_LEAST_1,
    "engine.startup_timeout_s": POSITIVE,
    "privacy.dp.clip": POSITIVE,
    "privacy.dp.delta": Range(lo=0, hi=1, lo_open=True, hi_open=True),
    "privacy.secagg.frac_bits": Range(lo=8, hi=40),
    "privacy.secagg.threshold": Range(lo=0, hi=1, hi_open=True),
    "privacy.secagg.dropout": Range(lo=0, hi=1, hi_open=True),
}


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+=,@-]{0,99}")


def check_name(value: Any, key: str) -> None:
    """A name that becomes part of a folder's name, a plot's title or a page (a run's `name`,
    a suite's or a sweep's, an algorithm label, a setting): letters, digits and `_.+=,@-`, not
    starting with `.` or `-`, at most 100 characters; never a path or markup.

    Raises:
        ConfigError: one line naming `key` and the rule.
    """
    require(
        isinstance(value, str) and NAME.fullmatch(value) is not None,
        key,
        f"{value!r} is not a name: use 1-100 letters, digits and _.+=,@- (starting with a "
        "letter or digit)",
    )


# Upper bounds that no experiment reaches, so that a typo (`engine.rounds=1e300`) is refused
# instead of running without end; checked after `RANGES`.
CAPS: dict[str, int] = {
    "seed": 2**32 - 1,  # numpy's legacy seeding takes 32 bits
    "engine.rounds": 1_000_000,
}


# --------------------------------------------------------------------------- parsing


def clients_per_round(cfg: RunConfig) -> int:
    return per_round(cfg.engine, cfg.data.num_clients)


def per_round(e: EngineConfig, num_clients: int) -> int:
    if e.clients_per_round is not None:
        return e.clients_per_round
    return max(1, round(e.fraction * num_clients))


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _options(tp: Any) -> list[str]:
    """The values a bool or Literal annotation allows, as a config writes them (else none)."""
    if tp is bool:
        return ["true", "false"]
    if typing.get_origin(tp) is Literal:
        return [str(a) for a in typing.get_args(tp)]
    return []


def convert(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the annotation `tp` and convert it (lists to tuples, ints to floats)."""
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
                return convert(value, arg, key)
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
            if isinstance(value, float) and value.is_integer():
                return _number(int(value), key)
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return _number(value, key)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return _number(float(value), key)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {_type_name(tp)} for {key}")


def _number(value: float, key: str) -> Any:
    """Every number in the schema is finite (and >= 0, see `from_dict`)."""
    if not math.isfinite(value):
        raise ConfigError(f"{key}: must be a finite number (got {value!r})")
    return value


# Settings that no longer exist, and why (docs/performance.md, "Engine options and what they cost")
REMOVED = {
    "engine.driver_trains": "the driver no longer trains beside the workers' actors; delete the "
    "key (engine.num_workers sets the workers)",
    "engine.lean_ray": "a private Ray now starts with Ray's supported options only; delete the key",
    "engine.grouped": "grouped (vectorized) client training was slower than the loop and is gone; "
    "delete the key",
}


def from_dict(cls: type, data: Any, prefix: str = "") -> Any:
    """Build dataclass `cls` from a mapping, refusing unknown keys and wrong types."""
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
            raise ConfigError(
                f"unknown key {prefix}{key}{suggest(str(key), fields)}; "
                f"valid keys under {prefix.rstrip('.') or 'the top level'}: {', '.join(fields)}"
            )
    kwargs = {
        name: convert(data[name], hints[name], f"{prefix}{name}") for name in fields if name in data
    }
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"missing key {prefix}{missing[0]}: set it in the YAML file")
    obj = cls(**kwargs)  # a section's own checks (an algorithm's Params) speak first
    non_negative(kwargs, prefix)
    return obj


def non_negative(values: Mapping[str, Any], prefix: str) -> None:
    """Every number in the schema is >= 0; `RANGES` and the algorithms' own checks narrow it."""
    for name, value in values.items():
        if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
            raise ConfigError(f"{prefix}{name}: must be >= 0 (got {value!r})")


def _dotted(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check(cfg: RunConfig) -> None:
    """Cross-field checks that need no data: ranges and registry names."""
    from rayfl.registry import DATASETS, PARTITIONERS
    from rayfl.resources import check_ray_num_cpus

    d, e = cfg.data, cfg.engine
    check_name(cfg.name, "name")
    if d.dataset not in DATASETS:
        DATASETS.get(d.dataset, key="data.dataset")
    if d.partition.name not in PARTITIONERS:
        PARTITIONERS.get(d.partition.name, key="data.partition.name")
    for key, rng in RANGES.items():
        value = _dotted(cfg, key)
        if value is not None:
            require(rng.contains(value), key, f"{rng.describe()} (got {shown(value)})")
    for key, cap in CAPS.items():
        value = _dotted(cfg, key)
        require(value <= cap, key, f"must be <= {cap} (got {shown(value)})")
    if e.clients_per_round is not None:
        require(
            e.clients_per_round <= d.num_clients,
            "engine.clients_per_round",
            f"{e.clients_per_round} sampled clients but only {d.num_clients} exist; "
            f"lower it or raise data.num_clients",
        )
    shapes = [("worker_resources", e.worker_resources), ("server_resources", e.server_resources)]
    shapes += [(f"resources_by_arch.{a}", r) for a, r in e.resources_by_arch.items()]
    for name, res in shapes:
        for attr in ("num_cpus", "num_gpus"):
            value = getattr(res, attr)
            require(value >= 0, f"engine.{name}.{attr}", f"must be >= 0 (got {value})")
            require(
                value <= 1 or float(value).is_integer(),
                f"engine.{name}.{attr}",
                f"fractions above 1 must be whole numbers (got {value})",
            )
    for name, res in shapes:
        require(
            name == "server_resources" or res.num_cpus > 0 or res.num_gpus > 0,
            f"engine.{name}",
            "a worker must reserve some CPU or GPU",
        )
    require(
        e.server_in != "driver"
        or (e.server_resources.num_cpus == 0 and e.server_resources.num_gpus == 0),
        "engine.server_in",
        "driver runs the server in the driver's process, which reserves nothing; set "
        "engine.server_resources to 0 CPU / 0 GPU, or use engine.server_in=actor",
    )
    check_domains(cfg)
    check_ray_num_cpus(e)  # a private Ray too small for one worker fails only after its start
    if cfg.model.proportions is not None:
        require(
            all(p > 0 for p in cfg.model.proportions),
            "model.proportions",
            "every proportion must be > 0",
        )
    require(
        all(0 < t <= 1 for t in cfg.eval.targets),
        "eval.targets",
        f"every target accuracy must be in (0, 1] (got {list(cfg.eval.targets)})",
    )
    check_feasible(cfg)


def check_domains(cfg: RunConfig) -> None:
    """`data.domains`: recipes, counts and the held-out domain, before any data is read."""
    from rayfl.data import transforms
    from rayfl.data.domains import client_counts

    d = cfg.data.domains
    require(d.noise >= 0, "data.domains.noise", f"must be >= 0 (got {d.noise})")
    for i, recipe in enumerate(d.transforms):
        transforms.parse(recipe, f"data.domains.transforms[{i}]")
    if d.transforms:
        client_counts(cfg.data.num_clients, d.transforms, d.proportions, d.clients_per_domain)
    if d.held_out is not None:
        require(
            cfg.eval.protocol == "deployed",
            "data.domains.held_out",
            "held-out clients never train, so only eval.protocol=deployed scores them",
        )
        require(
            not cfg.privacy.dp.enabled,
            "data.domains.held_out",
            "DP accounting assumes every client can be sampled; drop held_out or privacy.dp",
        )
        require(
            not d.transforms or d.held_out in d.transforms,
            "data.domains.held_out",
            f"{d.held_out!r} is not one of data.domains.transforms",
        )


# Training-set size and classes of the built-in datasets, known without loading them, so that
# an impossible partition is refused before any data is read or Ray started. A dataset not
# named here (a plugin's) is checked when its data is loaded.
DATASET_SIZES: dict[str, tuple[int, int]] = {
    "fmnist": (60_000, 10),
    "mnist": (60_000, 10),
    "cifar10": (50_000, 10),
    "cifar100": (50_000, 100),
    "tinyimagenet": (100_000, 200),
    "digits": (1_797, 10),  # before its own test split
}
SYNTHETIC_MAX_SAMPLES = 10_000_000  # 8x8 floats: 2.5 GB; more is a typo (1e12 was tried)


def _train_size(cfg: RunConfig) -> tuple[int, int] | None:
    """(training samples the partition splits, classes), or None when unknown without data."""
    d = cfg.data
    if d.dataset == "synthetic":
        opts = d.options
        n, classes = opts.get("num_samples", 2000), opts.get("num_classes", 10)
        for key, value in (("num_samples", n), ("num_test", opts.get("num_test", 500))):
            require(
                isinstance(value, int) and 1 <= value <= SYNTHETIC_MAX_SAMPLES,
                f"data.options.{key}",
                f"must be a whole number in [1, {SYNTHETIC_MAX_SAMPLES}] (got {value!r})",
            )
        if not isinstance(classes, int) or classes < 1:
            return None  # the loader names the problem
    elif d.dataset in DATASET_SIZES:
        n, classes = DATASET_SIZES[d.dataset]
        if d.dataset == "digits":
            n = int(n * (1 - float(d.options.get("test_fraction", 0.2))))
    else:
        return None
    if d.train_samples is not None:
        n = min(n, d.train_samples)
    return int(n * (1 - d.public_fraction)), classes


def check_feasible(cfg: RunConfig) -> None:
    """Refuse what would fail only once the data is loaded or a round ran: a partition the
    training set cannot give, more required replies than sampled clients.

    Raises:
        ConfigError: one line naming the key and the fix.
    """

    per_round = clients_per_round(cfg)
    require(
        cfg.engine.min_replies <= per_round,
        "engine.min_replies",
        f"{cfg.engine.min_replies} replies required but only {per_round} clients are sampled "
        "per round; lower it or sample more clients (engine.clients_per_round)",
    )
    size = _train_size(cfg)
    if size is None:
        return
    n, classes = size
    p, clients = cfg.data.partition, cfg.data.num_clients
    require(
        clients <= n,
        "data.num_clients",
        f"{clients} clients but {cfg.data.dataset} has {n} training samples to split; lower it",
    )
    if p.name == "pathological":
        require(
            p.classes_per_client <= classes,
            "data.partition.classes_per_client",
            f"{p.classes_per_client} classes per client but {cfg.data.dataset} has {classes}; "
            f"lower it to at most {classes}",
        )
    if p.name == "dirichlet":
        require(
            clients * p.min_samples <= n,
            "data.partition.min_samples",
            f"{clients} clients x {p.min_samples} samples exceeds the {n} training samples of "
            f"{cfg.data.dataset}; lower min_samples or data.num_clients",
        )
