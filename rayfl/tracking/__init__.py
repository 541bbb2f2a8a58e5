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
    STATUSES,
    Tracker,
    TrackerBase,
    default_tracking_uri,
    flatten_config,
)

__all__ = [
    "BACKENDS",
    "STATUSES",
    "Tracker",
    "TrackerBase",
    "default_tracking_uri",
    "flatten_config",
    "make_tracker",
]


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
    """Build the tracker named by the config key ``tracking.backend``.

    Args:
        backend: ``"mlflow"``, ``"stdout"`` or ``"none"``.
        experiment: Experiment name (MLflow creates it on first use).
        run_name: Display name of the run.
        tracking_uri: MLflow store; defaults to :func:`default_tracking_uri`.
        parent_run_id: Nest this run under another (a sweep's parent run).
        tags: Tags set when the run is created.
        run_id: Continue this MLflow run (a resumed simulation) instead of starting one.

    Returns:
        A started tracker; call ``close()`` when the run ends.

    Raises:
        ConfigError: ``backend`` is not a known backend.
    """
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
        from rayfl.tracking.stdout import StdoutTracker

        return StdoutTracker(experiment=experiment, run_name=run_name, tags=tags)
    if backend == "none":
        from rayfl.tracking.null import NullTracker

        return NullTracker()
    raise ConfigError(
        f"tracking.backend: unknown backend {backend!r}{suggest(backend, BACKENDS)}; "
        f"choose one of {', '.join(BACKENDS)}"
    )
