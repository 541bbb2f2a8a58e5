"""Experiment tracking: one protocol, interchangeable backends (MLflow, console, none).

Example:
    >>> from rayfl.tracking import make_tracker
    >>> with make_tracker("none", experiment="demo") as tracker:
    ...     tracker.log_metrics({"personal/acc": 0.5}, step=1)

Plots live in :mod:`rayfl.tracking.plots` (imported on demand: it pulls in matplotlib).
"""

from __future__ import annotations

from collections.abc import Mapping

from rayfl.errors import ConfigError, suggest
from rayfl.tracking.base import (
    BACKENDS,
    NullTracker,
    StdoutTracker,
    Tracker,
    default_tracking_uri,
    flatten_config,
)

__all__ = ["Tracker", "default_tracking_uri", "flatten_config", "make_tracker"]


def make_tracker(
    backend: str,
    *,
    experiment: str,
    run_name: str | None = None,
    tracking_uri: str | None = None,
    parent_run_id: str | None = None,
    tags: Mapping[str, str] | None = None,
    run_id: str | None = None,
) -> Tracker:
    """A started tracker for ``tracking.backend`` (``mlflow``, ``stdout`` or ``none``); call
    ``close()`` when the run ends. ``parent_run_id`` nests the run under a sweep's or suite's
    parent run; ``run_id`` continues that MLflow run (a resumed simulation); ``tracking_uri``
    defaults to :func:`default_tracking_uri`. A ConfigError names an unknown backend."""
    if backend == "mlflow":
        from rayfl.tracking.mlflow import MlflowTracker

        return MlflowTracker(
            experiment=experiment,
            run_name=run_name,
            tracking_uri=tracking_uri or default_tracking_uri(),
            parent_run_id=parent_run_id,
            tags=tags,
            run_id=run_id,
        )
    if backend == "stdout":
        return StdoutTracker(experiment=experiment, run_name=run_name, tags=tags)
    if backend == "none":
        return NullTracker()
    raise ConfigError(
        f"tracking.backend: unknown backend {backend!r}{suggest(backend, BACKENDS)}; "
        f"choose one of {', '.join(BACKENDS)}"
    )
