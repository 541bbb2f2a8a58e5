"""Named builders: algorithms, models, families, datasets, partitioners.

Every concept users pick by name in a config lives in one of these registries, so
`rayfl ls` can list it and a misspelt name fails with a suggestion.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from rayfl.errors import ConfigError, suggest

if TYPE_CHECKING:  # typing only: the algorithms import this module to register themselves
    from rayfl.algorithms.base import Algorithm

T = TypeVar("T")

# Modules whose import registers the built-in entries.
_BUILTIN_MODULES = (
    "rayfl.data.datasets",
    "rayfl.data.cifar",
    "rayfl.data.tinyimagenet",
    "rayfl.data.partition",
    "rayfl.models.zoo",
    "rayfl.models.families",
    "rayfl.algorithms",
)


class Registry(Generic[T]):
    """A name -> object mapping with a decorator to fill it."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in self._entries and self._entries[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = obj
            return obj

        return decorator

    def add(self, name: str, obj: T) -> T:
        return self.register(name)(obj)

    def get(self, name: str, key: str | None = None) -> T:
        """Look `name` up; an unknown name is a ConfigError naming `key` and the choices."""
        load_builtins()
        if name not in self._entries:
            where = f"{key}: " if key else ""
            raise ConfigError(
                f"{where}unknown {self.kind} {name!r}{suggest(name, self._entries)}; "
                f"choose one of {', '.join(sorted(self._entries))}"
            )
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        load_builtins()
        return name in self._entries

    def names(self) -> list[str]:
        load_builtins()
        return sorted(self._entries)

    def items(self) -> list[tuple[str, T]]:
        load_builtins()
        return sorted(self._entries.items())


ALGORITHMS: Registry[Algorithm[Any]] = Registry("algorithm")
MODELS: Registry[Any] = Registry("model")
FAMILIES: Registry[Any] = Registry("model family")
DATASETS: Registry[Any] = Registry("dataset")
PARTITIONERS: Registry[Any] = Registry("partitioner")

_loaded = False


def load_builtins() -> None:
    """Import the modules that register rayfl's built-in entries (once)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)
