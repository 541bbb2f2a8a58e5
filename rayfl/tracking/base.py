"""The tracker protocol every experiment sink implements, and the factory that picks one.

Modelled on torchtune's ``metric_logging``: a handful of methods (config, metrics per step,
artifacts, tags, close) so MLflow, the console and "nothing" are interchangeable and the engine
never imports a tracking library itself.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, TypeVar, runtime_checkable

BACKENDS = ("mlflow", "stdout", "none")
STATUSES = ("FINISHED", "FAILED", "KILLED")

_T = TypeVar("_T", bound="TrackerBase")


@runtime_checkable
class Tracker(Protocol):
    """A sink for one simulation run's config, per-round metrics and files.

    Implementations never raise from ``log_*`` because the sink failed (a tracking server
    outage must not end a simulation); they log a warning instead.

    Optional methods, looked up with ``getattr`` by the engine: ``log_dataset`` and
    ``log_missing(rows)``, which a resumed run calls with the ``(step, metrics)`` of the rounds
    its checkpoint restored, so that a store keeping history (MLflow) gets the ones it missed.

    Attributes:
        run_id: The backend's id for this run (MLflow run id), or None when it has none.
    """

    run_id: str | None

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Record the run's configuration (nested mappings are flattened to dotted keys)."""
        ...

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Record scalar metrics (keys like ``personal/acc/arch=cnn1``) at a round/step."""
        ...

    def log_artifact(self, path: str | Path) -> None:
        """Attach a file (plot, Parquet results, checkpoint) to the run."""
        ...

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set string tags on the run (e.g. algorithm, dataset, git commit)."""
        ...

    def close(self, status: str = "FINISHED") -> None:
        """End the run with FINISHED, FAILED or KILLED; calling it again does nothing."""
        ...


class TrackerBase:
    """Context-manager support shared by the trackers: ``with make_tracker(...) as t:``.

    The run is closed FINISHED on normal exit, KILLED on Ctrl-C and FAILED on any other error.
    """

    def close(self, status: str = "FINISHED") -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close("FINISHED")
        elif issubclass(exc_type, KeyboardInterrupt):
            self.close("KILLED")
        else:
            self.close("FAILED")


def check_status(status: str) -> str:
    """Return ``status`` upper-cased if it is a terminal run status, else raise ValueError."""
    upper = status.upper()
    if upper not in STATUSES:
        raise ValueError(f"run status {status!r} is not one of {', '.join(STATUSES)}")
    return upper


def plain(value: Any) -> Any:
    """Convert a config value to plain YAML/JSON types (dicts, lists, str, numbers, None).

    Dataclasses become dicts, tuples and sets lists, paths and enums their string/value, and
    anything else unknown its ``str`` so that a config can always be written out.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((plain(v) for v in value), key=repr)
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def flatten_config(config: Mapping[str, Any] | Any, sep: str = ".") -> dict[str, Any]:
    """Flatten nested mappings into dotted keys: ``{"a": {"b": 1}}`` -> ``{"a.b": 1}``.

    Lists stay values (MLflow shows them as strings); an empty mapping is kept as ``{}`` so
    that a present-but-empty section is still visible.

    Args:
        config: A mapping or a (nested) dataclass such as the frozen ``RunConfig``.
        sep: The separator between levels.

    Returns:
        A flat ``{dotted key: plain value}`` dict in the config's order.

    Example:
        >>> flatten_config({"engine": {"rounds": 5, "executor": {"workers": 2}}, "seed": 1})
        {'engine.rounds': 5, 'engine.executor.workers': 2, 'seed': 1}
    """
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping) and value:
            for k, v in value.items():
                walk(f"{prefix}{sep}{k}" if prefix else str(k), v)
        else:
            out[prefix] = value

    walk("", plain(config))
    return out


def default_tracking_uri() -> str:
    """Return ``$MLFLOW_TRACKING_URI`` if set, else a SQLite store in the working directory.

    The path is made absolute now because Ray Tune runs each trial in its own working
    directory: a relative ``sqlite:///mlflow.db`` would give every trial its own database.
    """
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"
