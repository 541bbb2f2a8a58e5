"""Plugins: a user's algorithms, models and datasets, registered like the built-ins.

A plugin is a module whose import registers entries in the domains' registries (as
`rayfl/algorithms/fedprox.py` does). It is named by `--plugin FILE_OR_MODULE` (or
`rayfl.run(plugins=...)`; relative to the current directory), by `plugins: [...]` in an
experiment file (relative to the file), or by an installed package's entry point in the groups
`rayfl.algorithms`, `rayfl.models`, `rayfl.datasets` (`rayfl.registry`). Built-ins load first,
so a clashing name fails at its registration. A file is imported as a module named after it,
so its classes pickle by reference; every Ray worker imports the same plugins as it starts
(`runtime_env` names them; `setup_worker` is Ray's `worker_process_setup_hook`), so on a
cluster the file must exist at the same path on every node. A run directory's `config.yaml`
never imports plugins (untrusted input): `rayfl run --resume DIR --plugin my_algos.py`.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rayfl import registry
from rayfl.errors import ConfigError, UserError
from rayfl.registry import failure, source

ENV = "RAYFL_PLUGINS"  # the plugins a Ray worker imports (JSON list), set through runtime_env
KEY = "plugins"  # the experiment file's key

# Every plugin named in this process, in order: resolved spec -> imported yet.
_plugins: dict[str, bool] = {}


def resolve(spec: Any, base: Path | None = None) -> str:
    """One plugin as an absolute `.py` path (relative to `base`, default the current
    directory) or a dotted module name; a ConfigError when it is neither."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"plugin {spec!r}: name a .py file or an importable module")
    spec = spec.strip()
    if not _is_file_spec(spec):
        return spec
    path = Path(spec).expanduser()
    if not path.is_absolute():
        path = (base or Path.cwd()) / path
    path = path.resolve()
    if not path.is_file():
        raise ConfigError(f"plugin {spec}: file {path} not found; check the path")
    return str(path)


def _is_file_spec(spec: str) -> bool:
    return spec.endswith(".py") or os.sep in spec or "/" in spec


def add(specs: str | Sequence[str] | None, base: Path | None = None) -> list[str]:
    """Name plugins for this process (imported at the next registry lookup); returns them
    resolved. Naming one twice is harmless."""
    if specs is None:
        return []
    if isinstance(specs, str):
        specs = [specs]
    if not isinstance(specs, Sequence):
        raise ConfigError(f"{KEY}: expected a list of .py files or module names, got {specs!r}")
    resolved = [resolve(s, base) for s in specs]
    for spec in resolved:
        _plugins.setdefault(spec, False)
    return resolved


def take(raw: Mapping[str, Any], base: Path | None = None) -> dict[str, Any]:
    """`raw` without its `plugins` key, whose plugins are named for this process (`add`)."""
    rest = dict(raw)
    add(rest.pop(KEY, None), base)
    return rest


def absolute(raw: dict[str, Any], base: Path) -> dict[str, Any]:
    """A file's `plugins` entries resolved against the file's folder `base` (in place)."""
    if isinstance(raw.get(KEY), list | str):
        specs = [raw[KEY]] if isinstance(raw[KEY], str) else raw[KEY]
        raw[KEY] = [resolve(s, base) for s in specs]
    return raw


def active() -> list[str]:
    """Every plugin named in this process (resolved), in order."""
    return list(_plugins)


def load_pending() -> None:
    """Import every named plugin not imported yet (after the built-ins: see the module doc)."""
    for spec, done in list(_plugins.items()):
        if not done:
            _plugins[spec] = True  # before the import: a lookup inside it must not recurse
            try:
                _import(spec)
            except BaseException:
                _plugins[spec] = False
                raise


def _import(spec: str) -> None:
    with source(f"plugin {spec}"):
        try:
            if _is_file_spec(spec):
                _import_file(Path(spec))
            else:
                importlib.import_module(spec)
        except UserError as exc:
            raise UserError(f"plugin {spec}: {exc}") from None
        except ModuleNotFoundError as exc:
            if exc.name and (spec == exc.name or spec.startswith(f"{exc.name}.")):
                raise UserError(
                    f"plugin {spec}: no module named {spec!r}; pass a .py file or an importable module"
                ) from None
            raise UserError(f"plugin {spec} failed to import: {failure(exc, spec)}") from None
        except Exception as exc:
            raise UserError(f"plugin {spec} failed to import: {failure(exc, spec)}") from None


def _import_file(path: Path) -> None:
    name = path.stem
    loaded = sys.modules.get(name)
    if loaded is not None:
        if Path(getattr(loaded, "__file__", "") or "").resolve() == path:
            return
        raise UserError(
            f"a module named {name!r} is already imported (from {getattr(loaded, '__file__', '?')}); "
            "rename the plugin file"
        )
    if not name.isidentifier():
        raise UserError(f"{path.name} is not a valid module name; rename it (e.g. my_algos.py)")
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise UserError(f"{path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # under its name: its classes pickle by reference
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise


def runtime_env() -> dict[str, Any]:
    """The `runtime_env` environment that names this process's plugins to every worker ({}
    when there are none); `rayfl.engine.startup.worker_runtime_env` adds the rest."""
    if not _plugins:
        return {}
    return {"env_vars": {ENV: json.dumps(active())}}


def setup_worker() -> None:
    """Ray's `worker_process_setup_hook`: import the driver's plugins in this worker process."""
    add(json.loads(os.environ.get(ENV, "[]")))
    registry.load()


registry.add_loader(load_pending)  # at every lookup: the plugins named since the last one
