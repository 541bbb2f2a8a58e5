"""The tracker every experiment sink derives from, and the console and null trackers.

Modelled on torchtune's ``metric_logging``: a handful of methods (config, metrics per step,
artifacts, tags, close) so MLflow, the console and "nothing" are interchangeable and the engine
never imports a tracking library itself.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import yaml

BACKENDS = ("mlflow", "stdout", "none")
STATUSES = ("FINISHED", "FAILED", "KILLED")

_T = TypeVar("_T", bound="Tracker")
logger = logging.getLogger("rayfl.tracking.stdout")


class Tracker:
    """A sink for one run's config, per-round metrics (keys like ``personal/acc/arch=cnn1``),
    files and string tags. ``log_*`` never raise because the sink failed (a tracking server
    outage must not end a simulation); they warn instead. ``close`` takes FINISHED, FAILED or
    KILLED and does nothing the second time.

    Optional methods, looked up with ``getattr`` by the engine: ``log_dataset`` and
    ``log_missing(rows)``, which a resumed run calls with the ``(step, metrics)`` of the rounds
    its checkpoint restored, so that a store keeping history (MLflow) gets the ones it missed.
    ``run_id`` is the backend's id for the run (MLflow run id), or None.

    The base class keeps nothing and is every tracker's context manager: the run is closed
    FINISHED on normal exit, KILLED on Ctrl-C and FAILED on any other error.
    """

    run_id: str | None = None

    def log_config(self, config: Mapping[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_artifact(self, path: str | Path) -> None:
        pass

    def set_tags(self, tags: Mapping[str, str]) -> None:
        pass

    def close(self, status: str = "FINISHED") -> None:
        check_status(status)  # so that typos surface in tests too

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
        else:
            self.close("KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")


class NullTracker(Tracker):
    """``tracking.backend: none`` (tests, benchmarks): accepts every call, keeps nothing."""


class StdoutTracker(Tracker):
    """``tracking.backend: stdout``: everything goes to ``logging`` at INFO (logger
    ``rayfl.tracking.stdout``); no files, no server."""

    def __init__(
        self,
        *,
        experiment: str = "default",
        run_name: str | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> None:
        self.experiment = experiment
        self.run_name = run_name
        self._closed = False
        logger.info("run %s in experiment %r", run_name or "(unnamed)", experiment)
        if tags:
            self.set_tags(tags)

    def log_config(self, config: Mapping[str, Any]) -> None:
        logger.info("config:\n%s", yaml.safe_dump(plain(config), sort_keys=False).rstrip())

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if metrics:
            logger.info("%s", format_metrics(metrics, step))

    def log_artifact(self, path: str | Path) -> None:
        logger.info("artifact: %s", Path(path).resolve())  # the file stays where it is

    def set_tags(self, tags: Mapping[str, str]) -> None:
        if tags:
            logger.info("tags: %s", ", ".join(f"{k}={v}" for k, v in tags.items()))

    def close(self, status: str = "FINISHED") -> None:
        status = check_status(status)
        if not self._closed:
            self._closed = True
            logger.info("run %s ended: %s", self.run_name or "(unnamed)", status)


def format_metrics(metrics: Mapping[str, float], step: int) -> str:
    """One step's metrics as a single sorted ``key=value`` line.

    Example:
        >>> format_metrics({"personal/acc": 0.81234, "comm/bytes_up": 12000}, step=3)
        'step 3: comm/bytes_up=12000 personal/acc=0.8123'
    """
    parts = []
    for key in sorted(metrics):
        value = metrics[key]
        finite = isinstance(value, float) and math.isfinite(value)
        parts.append(f"{key}={f'{value:.4g}' if finite and not value.is_integer() else value}")
    return f"step {step}: " + " ".join(parts)


def check_status(status: str) -> str:
    """Return ``status`` upper-cased if it is a terminal run status, else raise ValueError."""
    upper = status.upper()
    if upper not in STATUSES:
        raise ValueError(f"run status {status!r} is not one of {', '.join(STATUSES)}")
    return upper


def plain(value: Any) -> Any:
    """A config value as plain YAML/JSON types: dataclasses become dicts, tuples and sets lists,
    paths and enums their string/value, anything else unknown its ``str``."""
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
    """Nested mappings (or a nested dataclass such as ``RunConfig``) as dotted keys, in order.
    Lists stay values; an empty mapping is kept as ``{}`` so an empty section stays visible.

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
    """``$MLFLOW_TRACKING_URI`` if set, else a SQLite store in the working directory, made
    absolute now: Ray Tune runs each trial in its own working directory."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"


def absolute_uri(uri: str | None) -> str:
    """`uri` (default: `default_tracking_uri`) with a relative SQLite path made absolute: Tune
    trials run in their own directories."""
    uri = uri or default_tracking_uri()
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        return prefix + str((Path.cwd() / uri[len(prefix) :]).resolve())
    return uri
