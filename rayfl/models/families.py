"""Model families: named heterogeneity settings (which architectures clients get).

A `Family` is an ordered tuple of architecture names from `MODELS` (the built-ins are
registered at the end, `rayfl ls families` lists them); `assign` maps client ids to them,
round-robin (pFedES's official `k % 5`) or in contiguous blocks of given proportions. A config
may instead list architectures (`model.architectures`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from rayfl.errors import ConfigError
from rayfl.models.base import MODELS, build_model
from rayfl.models.zoo import AUXILIARY_MODELS
from rayfl.registry import Registry

__all__ = ["Family", "family_from_config", "get_family"]

_PROPORTION_TOL = 1e-6


@functools.lru_cache(maxsize=256)
def _feature_dim(arch: str, in_shape: tuple[int, ...], num_classes: int) -> int:
    # Building a model (e.g. ResNet-18) is not free and families ask repeatedly: remember.
    return int(build_model(arch, in_shape, num_classes).feature_dim)


@dataclass(frozen=True)
class Family:
    """Ordered client architectures (a repeat is another round-robin slot); `custom` is the
    name of a config's explicit list."""

    name: str
    architectures: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.architectures:
            raise ConfigError(f"model family {self.name!r} has no architectures; list at least one")

    def assign(self, num_clients: int, proportions: Sequence[float] | None = None) -> list[str]:
        """Architecture of each client id: client k gets `architectures[k % m]`, or, with
        `proportions` (one per architecture, > 0, summing to 1), contiguous blocks of
        `proportions * num_clients` clients by largest remainder (ties to the earlier).

        >>> Family("f", ("a", "b", "c")).assign(7, [0.5, 0.3, 0.2])
        ['a', 'a', 'a', 'a', 'b', 'b', 'c']
        """
        if num_clients < 1:
            raise ConfigError(f"number of clients is {num_clients}; it must be >= 1")
        m = len(self.architectures)
        if proportions is None:
            return [self.architectures[k % m] for k in range(num_clients)]
        sizes = _block_sizes(num_clients, self._check_proportions(proportions))
        out: list[str] = []
        for arch, size in zip(self.architectures, sizes):
            out.extend([arch] * size)
        return out

    def _check_proportions(self, proportions: Sequence[float]) -> list[float]:
        props = [float(p) for p in proportions]
        m = len(self.architectures)
        if len(props) != m:
            raise ConfigError(
                f"model.proportions has {len(props)} entries but family {self.name!r} has {m} "
                f"architectures ({', '.join(self.architectures)}); give one proportion each"
            )
        if any(not math.isfinite(p) or p <= 0 for p in props):
            raise ConfigError(
                f"model.proportions {props} must all be > 0; drop an architecture instead of "
                "giving it 0"
            )
        total = math.fsum(props)
        if abs(total - 1.0) > _PROPORTION_TOL:
            raise ConfigError(f"model.proportions {props} sum to {total:g}; they must sum to 1")
        return props

    @property
    def homogeneous(self) -> bool:
        return len(set(self.architectures)) == 1

    def feature_dims(self, in_shape: Sequence[int], num_classes: int) -> dict[str, int]:
        """`feature_dim` of each distinct architecture for inputs of `in_shape` (cached)."""
        shape = tuple(int(d) for d in in_shape)
        return {arch: _feature_dim(arch, shape, int(num_classes)) for arch in self.architectures}

    def common_feature_dim(self, in_shape: Sequence[int], num_classes: int) -> int | None:
        """The feature size shared by all architectures, or None when they differ."""
        dims = set(self.feature_dims(in_shape, num_classes).values())
        return dims.pop() if len(dims) == 1 else None


def _block_sizes(n: int, proportions: Sequence[float]) -> list[int]:
    """Largest-remainder rounding of `proportions * n` to integers summing to `n`."""
    quotas = [p * n for p in proportions]
    sizes = [math.floor(q) for q in quotas]
    # Round remainders so float noise (0.35 * 10 = 3.4999...) cannot break a real tie;
    # ties go to the lower index for determinism.
    order = sorted(range(len(quotas)), key=lambda i: (-round(quotas[i] - sizes[i], 9), i))
    for i in order[: n - sum(sizes)]:
        sizes[i] += 1
    return sizes


def get_family(name: str) -> Family:
    """The registered family `name` (ConfigError naming `model.family` if unknown)."""
    family: Family = FAMILIES.get(name, key="model.family")
    return family


def family_from_config(name: str, architectures: Sequence[str] | None = None) -> Family:
    """The family a config asks for: registered `name`, or `custom` from an explicit list of
    classifiers (`model.architectures`, then `name` is ignored)."""
    if architectures is None:
        return get_family(name)
    archs = tuple(architectures)
    if not archs:
        raise ConfigError("model.architectures is empty; list at least one model or omit it")
    for arch in archs:
        MODELS.get(arch, key="model.architectures")
        if arch in AUXILIARY_MODELS:
            raise ConfigError(
                f"model.architectures: {arch!r} is not a classifier and cannot be a client "
                "model; pick another architecture"
            )
    return Family("custom", archs)


# Family name -> `Family`; the built-ins below.
FAMILIES: Registry[Family] = Registry("model family")
FAMILIES.add("seed3", Family("seed3", ("cnn_small", "resnet_small", "mlp")))
FAMILIES.add("cnn5", Family("cnn5", tuple(f"cnn{k}" for k in range(1, 6))))
FAMILIES.add(
    "resnet_widths", Family("resnet_widths", tuple(f"resnet18_w{k}" for k in range(1, 11)))
)
FAMILIES.add("homo_cnn_small", Family("homo_cnn_small", ("cnn_small",)))
FAMILIES.add("tiny2", Family("tiny2", ("tiny_a", "tiny_b")))
