"""The plotting process: draws a run's plots at the lowest priority; the driver draws whatever it
did not deliver."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import psutil
import pytest

from rayfl.config import build_config
from rayfl.engine.callbacks import RunDirectory
from rayfl.engine.loop import Simulation
from rayfl.engine.rundir import strict_json
from rayfl.tracking import plotter

PNG = b"\x89PNG\r\n\x1a\n"
HISTORY = [
    {"round": 1.0, "personal/acc": 0.5, "personal/acc/arch=a": 0.5, "global/acc": float("nan")},
    {"round": 2.0, "personal/acc": 0.6, "personal/acc/arch=a": 0.6, "global/acc": 0.4},
]


def test_the_plotting_process_answers_each_job_and_reports_a_failed_one(tmp_path) -> None:
    jobs = [
        {
            "job": "labels",
            "counts": [[3, 1], [0, 4]],
            "dataset": "toy",
            "path": str(tmp_path / "l.png"),
        },
        json.loads(
            strict_json({"job": "curves", "history": HISTORY, "title": "t", "dir": str(tmp_path)})
        ),
        {"job": "sketch"},
    ]
    out = io.StringIO()
    plotter.serve(io.StringIO("".join(json.dumps(j) + "\n" for j in jobs)), out)
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert replies[0] == {"job": "labels", "paths": [str(tmp_path / "l.png")]}
    assert replies[1]["paths"] == [
        str(tmp_path / plotter.CURVES),
        str(tmp_path / plotter.PER_ARCH),
    ]
    assert replies[2]["job"] == "sketch" and "unknown job" in replies[2]["error"]
    for path in [*replies[0]["paths"], *replies[1]["paths"]]:
        assert Path(path).read_bytes()[:8] == PNG


@pytest.mark.slow
def test_the_plotting_process_runs_at_the_lowest_priority_and_delivers(tmp_path) -> None:
    proc = plotter.PlotProcess()
    assert proc._proc is not None
    child = psutil.Process(proc._proc.pid)

    def lowest() -> bool:  # SCHED_IDLE where Linux has it (below every niceness), else nice 19
        if hasattr(os, "sched_getscheduler"):
            return os.sched_getscheduler(child.pid) == os.SCHED_IDLE
        return child.nice() == plotter.NICENESS

    deadline = time.monotonic() + 30
    while not lowest() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert lowest()
    proc.send(
        {"job": "labels", "counts": [[1, 2]], "dataset": "toy", "path": str(tmp_path / "x.png")}
    )
    assert proc.finish() == {"labels": [tmp_path / "x.png"]}
    assert (tmp_path / "x.png").read_bytes()[:8] == PNG


@pytest.mark.slow
@pytest.mark.parametrize("how", ["dies", "none"])
def test_a_run_gets_its_plots_when_the_plotting_process_dies_or_is_off(
    synthetic_raw, tmp_path, monkeypatch, how
) -> None:
    if how == "dies":  # it starts, but is gone before it draws anything
        monkeypatch.setattr(plotter.sys, "executable", "/bin/false")
    run_dir = RunDirectory(tmp_path, plot_process=how != "none")
    cfg = build_config(synthetic_raw, ["engine.rounds=2"])
    Simulation(cfg, tmp_path, [run_dir]).run()
    for name in (plotter.LABELS, plotter.CURVES, plotter.PER_ARCH):
        assert (tmp_path / name).read_bytes()[:8] == PNG, name
        assert tmp_path / name in run_dir.artifacts
