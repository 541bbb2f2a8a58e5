"""Console tracker: metrics and config go to ``logging`` at INFO (no files, no server)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from rayfl.tracking.base import TrackerBase, check_status, plain

logger = logging.getLogger(__name__)


def format_metrics(metrics: Mapping[str, float], step: int) -> str:
    """Render one step's metrics as a single sorted ``key=value`` line.

    Example:
        >>> format_metrics({"personal/acc": 0.81234, "comm/bytes_up": 12000}, step=3)
        'step 3: comm/bytes_up=12000 personal/acc=0.8123'
    """
    parts = []
    for key in sorted(metrics):
        value = metrics[key]
        if isinstance(value, float) and math.isfinite(value) and not value.is_integer():
            text = f"{value:.4g}"
        else:
            text = str(value)
        parts.append(f"{key}={text}")
    return f"step {step}: " + " ".join(parts)


class StdoutTracker(TrackerBase):
    """Tracker that logs everything through ``logging`` (logger ``rayfl.tracking.stdout``).

    Args:
        experiment: Experiment name, shown in the first log line.
        run_name: Run name, shown in the first log line.
        tags: Tags logged at start.
    """

    def __init__(
        self,
        *,
        experiment: str = "default",
        run_name: str | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> None:
        self.run_id: str | None = None
        self.experiment = experiment
        self.run_name = run_name
        self._closed = False
        logger.info("run %s in experiment %r", run_name or "(unnamed)", experiment)
        if tags:
            self.set_tags(tags)

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Log the config as YAML at INFO."""
        logger.info("config:\n%s", yaml.safe_dump(plain(config), sort_keys=False).rstrip())

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Log one line per step with every metric, keys sorted."""
        if metrics:
            logger.info("%s", format_metrics(metrics, step))

    def log_artifact(self, path: str | Path) -> None:
        """Log the artifact's path (the file stays where it is)."""
        logger.info("artifact: %s", Path(path).resolve())

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Log the tags."""
        if tags:
            logger.info("tags: %s", ", ".join(f"{k}={v}" for k, v in tags.items()))

    def close(self, status: str = "FINISHED") -> None:
        """Log the final status once."""
        status = check_status(status)
        if self._closed:
            return
        self._closed = True
        logger.info("run %s ended: %s", self.run_name or "(unnamed)", status)
