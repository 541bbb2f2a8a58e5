"""A run's plots drawn by a process of their own, at the lowest CPU priority (`PlotProcess`).

A run's run directory gets three plots: the label distribution (known once the data is
partitioned), the learning curves and the accuracy per architecture (known once it ends). Drawn
in the driver at the end, they held up its exit by ~1 s on the 2-core benchmark: 0.45 s to
import matplotlib beside Ray's shutdown, 0.2 s for the label distribution, 0.3 s for the
curves, on one core while the other had nothing left to do. The plotting process starts with
the run at the lowest CPU priority (`lowest_priority`), so it imports matplotlib and draws the
label distribution in the CPU time the run leaves idle (the ends of rounds) without taking any
from training;
at the end it draws the curves while the driver shuts Ray down. Whatever it has not delivered
when the run ends (it failed, it was killed, the machine is too busy for it) is drawn in the
driver as before: the plots never depend on it.

The protocol is one JSON line per job on its stdin and one JSON line per finished job on its
stdout: `{"job": "labels", "counts": [[...]], "dataset": "fmnist", "path": "..."}`,
`{"job": "curves", "history": [...], "title": "...", "dir": "..."}`; it answers
`{"job": ..., "paths": [...]}` or `{"job": ..., "error": "..."}` and exits at the end of stdin.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger(__name__)

NICENESS = 19
LABELS = "label_distribution.png"
CURVES = "learning_curves.png"
PER_ARCH = "per_architecture.png"


class PlotProcess:
    """The driver's end of the plotting process; every method is safe to call when the process
    is gone (it then returns nothing, and the caller draws in-process)."""

    def __init__(self) -> None:
        from rayfl.engine.startup import python_command

        self._proc: subprocess.Popen[str] | None = None
        try:
            self._proc = subprocess.Popen(
                python_command("rayfl.tracking.plotter"),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env={**os.environ, "MPLBACKEND": "Agg"},
            )
        except OSError as exc:
            log.warning("no plotting process (%s); the plots are drawn at the end instead", exc)

    def send(self, job: Mapping[str, Any]) -> None:
        """One job, as strict JSON (NaN and inf as null: a missing point of a curve)."""
        from rayfl.engine.rundir import strict_json

        if self._proc is None or self._proc.stdin is None:
            return
        try:
            self._proc.stdin.write(strict_json(job) + "\n")
            self._proc.stdin.flush()
        except (OSError, ValueError):
            self.stop()

    def finish(self, timeout_s: float = 60.0) -> dict[str, list[Path]]:
        """End of stdin; wait up to `timeout_s` for the jobs sent. Returns each finished job's
        files (a job that failed or did not finish in time is missing)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return {}
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except (subprocess.TimeoutExpired, OSError, ValueError):
            proc.kill()
            proc.communicate()
            log.warning("the plotting process took over %.0f s; drawing here", timeout_s)
            return {}
        done: dict[str, list[Path]] = {}
        for line in out.splitlines():
            try:
                reply = json.loads(line)
            except ValueError:
                continue
            if "error" in reply:
                log.warning("the plotting process failed on %s: %s", reply["job"], reply["error"])
            else:
                done[reply["job"]] = [Path(p) for p in reply["paths"]]
        return done

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()


def draw(job: Mapping[str, Any]) -> list[Path]:
    """Draw one job's plots (in the plotting process; the driver draws the same ones itself
    when it has to)."""
    from rayfl.tracking.plots import (
        ARCH_PREFIX,
        plot_class_counts,
        plot_learning_curves,
        plot_per_architecture,
    )

    if job["job"] == "labels":
        return [plot_class_counts(job["counts"], job["dataset"], job["path"])]
    if job["job"] == "curves":
        history: Sequence[Mapping[str, Any]] = job["history"]
        folder = Path(job["dir"])
        paths = [plot_learning_curves(history, folder / CURVES, title=job["title"])]
        if history and any(k.startswith(ARCH_PREFIX) for k in history[-1]):
            paths.append(plot_per_architecture(history, folder / PER_ARCH))
        return paths
    raise ValueError(f"unknown job {job['job']!r}")


def serve(lines: TextIO, out: TextIO) -> None:
    """The plotting process: draw each job read from `lines`, answer on `out`."""
    for line in lines:
        if not line.strip():
            continue
        job = json.loads(line)
        try:
            reply: dict[str, Any] = {"job": job["job"], "paths": [str(p) for p in draw(job)]}
        except Exception as exc:  # reported to the driver, which draws it itself
            reply = {"job": job.get("job"), "error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


def lowest_priority() -> None:
    """Run this process only on CPU time nothing else wants: Linux's SCHED_IDLE policy, else
    niceness 19. Niceness alone is not enough beside Ray, whose workers run at niceness 15:
    at 19 this process still got ~30% of a core from a training worker (CFS weights 15 against
    36), and imported matplotlib in the middle of a round."""
    set_policy = getattr(os, "sched_setscheduler", None)
    if set_policy is not None and hasattr(os, "SCHED_IDLE"):
        with suppress(OSError):
            set_policy(0, os.SCHED_IDLE, os.sched_param(0))
            return
    with suppress(OSError):
        os.nice(NICENESS)


def main() -> None:
    lowest_priority()
    import rayfl.tracking.plots  # noqa: F401  (matplotlib: imported while the run trains)

    serve(sys.stdin, sys.stdout)


if __name__ == "__main__":
    main()
