"""Tracker that records nothing (``tracking.backend: none``): for tests and benchmarks."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rayfl.tracking.base import TrackerBase, check_status


class NullTracker(TrackerBase):
    """Accepts every call and keeps nothing; ``run_id`` is always None."""

    def __init__(self) -> None:
        self.run_id: str | None = None

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Do nothing."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Do nothing."""

    def log_artifact(self, path: str | Path) -> None:
        """Do nothing."""

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Do nothing."""

    def close(self, status: str = "FINISHED") -> None:
        """Check ``status`` (so typos surface in tests too) and do nothing else."""
        check_status(status)
