"""Named builders: algorithms, models, families, datasets, partitioners.

Every concept users pick by name in a config lives in one of these registries, so
`rayfl ls` can list it and a misspelt name fails with a suggestion. A user's own entries come
from plugins (`rayfl.plugins`), registered the same way after the built-ins.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
    "rayfl.data.folder",
    "rayfl.data.partition",
    "rayfl.models.zoo",
    "rayfl.models.families",
    "rayfl.algorithms",
    "rayfl.plugins",  # adds the loaders of entry points and named plugins (`add_loader`)
)

# Run after the built-ins on every `load_builtins` (rayfl.plugins adds its two at import): kept
# as callables so that this module imports none of the modules that register entries.
_loaders: list[Callable[[], None]] = []


def add_loader(loader: Callable[[], None]) -> None:
    """Call `loader` after the built-ins are registered, at every `load_builtins`."""
    if loader not in _loaders:
        _loaders.append(loader)


# Who is registering now: "built-in", or the plugin being imported (`source`).
_source = "built-in"


@contextmanager
def source(label: str) -> Iterator[None]:
    """Entries registered inside the block come from `label` (named when two clash)."""
    global _source
    previous, _source = _source, label
    try:
        yield
    finally:
        _source = previous


class Registry(Generic[T]):
    """A name -> object mapping with a decorator to fill it."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._sources: dict[str, str] = {}

    def register(self, name: str) -> Callable[[T], T]:
        from rayfl.config_checks import check_name

        # a name reaches folder names, plot labels and pages: never a path or markup
        check_name(name, f"{self.kind} registered by {_source}")

        def decorator(obj: T) -> T:
            if name in self._entries and self._entries[name] is not obj:
                raise ConfigError(
                    f"{self.kind} {name!r} is already registered ({self._sources[name]}); "
                    "register yours under another name"
                )
            self._entries[name] = obj
            self._sources[name] = _source
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
                f"choose one of {', '.join(sorted(self._entries))} "
                "(or load yours with --plugin FILE)"
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
_builtins_done = False


def load_builtins() -> None:
    """Import the modules that register rayfl's built-in entries and the installed entry points
    (once), then the plugins named since the last call (`rayfl.plugins`)."""
    global _loaded, _builtins_done
    if not _loaded:
        _loaded = True
        for module in _BUILTIN_MODULES:
            importlib.import_module(module)
        _builtins_done = True
    if _builtins_done:  # not while a built-in module's import looks an entry up
        for loader in _loaders:
            loader()
