"""A name -> object registry with a decorator to fill it; it knows no domain.

Each domain owns its registry beside what it registers (`rayfl.algorithms.ALGORITHMS`,
`rayfl.models.MODELS` and `FAMILIES`, `rayfl.data.DATASETS` and `PARTITIONERS`), and the
package that defines it imports its built-in entries, so a registry is full as soon as it can be
imported. Before a lookup, every registry runs the loaders added with `add_loader` (the named
plugins, `rayfl.plugins`) and once the installed entry points of every group a registry names,
so a user's entries appear the same way everywhere, Ray workers included.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import metadata
from typing import Generic, TypeVar

from rayfl.errors import ConfigError, UserError, check_name, suggest

T = TypeVar("T")

# Run before every lookup (rayfl.plugins adds the import of the plugins named since the last).
_loaders: list[Callable[[], None]] = []
# Who is registering now: "built-in", or the plugin or entry point being imported (`source`).
_source = "built-in"
# Every registry, for the entry points of its group; the groups whose entry points are loaded.
_registries: list[Registry[object]] = []
_groups_loaded: set[str] = set()


def add_loader(loader: Callable[[], None]) -> None:
    """Call `loader` before every registry lookup (it must be cheap when it has nothing to do)."""
    if loader not in _loaders:
        _loaders.append(loader)


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
    """Named entries of one `kind`; `group` names the entry point group that adds to it."""

    def __init__(self, kind: str, group: str | None = None) -> None:
        self.kind = kind
        self.group = group
        self._entries: dict[str, T] = {}
        self._sources: dict[str, str] = {}
        _registries.append(self)  # type: ignore[arg-type]

    def register(self, name: str) -> Callable[[T], T]:
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
        load()
        if name not in self._entries:
            where = f"{key}: " if key else ""
            raise ConfigError(
                f"{where}unknown {self.kind} {name!r}{suggest(name, self._entries)}; "
                f"choose one of {', '.join(sorted(self._entries))} "
                "(or load yours with --plugin FILE)"
            )
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        load()
        return name in self._entries

    def names(self) -> list[str]:
        load()
        return sorted(self._entries)

    def items(self) -> list[tuple[str, T]]:
        load()
        return sorted(self._entries.items())


def load() -> None:
    """The installed entry points of every registry's group (once each), then the loaders."""
    for registry in list(_registries):
        group = registry.group
        if group is None or group in _groups_loaded:
            continue
        _groups_loaded.add(group)
        for ep in metadata.entry_points(group=group):
            package = ep.dist.name if ep.dist is not None else "?"
            label = f"entry point {ep.name} = {ep.value} ({group}, package {package})"
            with source(label):
                try:
                    obj = ep.load()
                except UserError as exc:
                    raise UserError(f"{label}: {exc}") from None
                except Exception as exc:
                    raise UserError(f"{label} failed to import: {failure(exc, '')}") from None
                if not isinstance(obj, type(sys)):  # an object, not a module: register it
                    registry.add(ep.name, obj)
    for loader in _loaders:
        loader()


def failure(exc: BaseException, filename: str) -> str:
    """`Type: message (file:line: code)` of a failed import, at the deepest frame in
    `filename` (else the deepest outside importlib)."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"SyntaxError: {exc.msg} ({exc.filename}:{exc.lineno})"
    message = str(exc).strip()
    text = f"{type(exc).__name__}: {message.splitlines()[0] if message else ''}"
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if f.filename == filename] or [
        f for f in frames if "importlib" not in f.filename
    ]
    if own:
        frame = own[-1]
        return f"{text} ({frame.filename}:{frame.lineno}: {(frame.line or '').strip()})"
    return text
