"""Experiment tracking: one protocol, interchangeable backends (MLflow, console, none).

Example:
    >>> from rayfl.tracking import make_tracker
    >>> with make_tracker("none", experiment="demo") as tracker:
    ...     tracker.log_metrics({"personal/acc": 0.5}, step=1)

Plots live in :mod:`rayfl.tracking.plots` (imported on demand: it pulls in matplotlib).
"""

from rayfl.tracking.base import (
    BACKENDS,
    STATUSES,
    Tracker,
    TrackerBase,
    default_tracking_uri,
    flatten_config,
    make_tracker,
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
