"""`rayfl` under faults: SIGTERM like Ctrl-C, one-line errors, rejected replies in the table,
`rayfl ls-runs`."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rayfl import cli, gate
from rayfl.config import build_config, load_config
from rayfl.engine.checkpoint import verify
from rayfl.engine.loop import RunResult
from tests.conftest import SYNTHETIC
from tests.test_cli import rayfl

ROOT = Path(__file__).resolve().parents[1]


def write_config(tmp_path, engine):
    raw = yaml.safe_load(yaml.safe_dump(SYNTHETIC))
    raw["engine"].update(engine)
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.slow
def test_sigterm_stops_a_ray_run_like_ctrl_c_with_the_checkpoint_intact(tmp_path):
    engine = {
        "rounds": 200,
        "executor": "ray",
        "num_workers": 1,
        "ray_num_cpus": 1,
        "checkpoint_every": 1,
    }
    config = write_config(tmp_path, engine)
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rayfl.cli", "run", str(config), "--out", str(out), "--no-progress"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        deadline = time.monotonic() + 240
        while not (out / "checkpoint").is_symlink() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "--resume" in err and "Traceback" not in err and "SIGTERM" not in err
    restored = verify(out, load_config(out / "config.yaml"))
    assert restored.round >= 1
    assert json.loads((out / "summary.json").read_text())["status"] == "KILLED"


@pytest.mark.slow
def test_unwritable_out_and_a_directory_as_config_are_one_line(tmp_path):
    config = write_config(tmp_path, {})
    blocker = tmp_path / "file"
    blocker.write_text("")
    for args, needle in (
        (["run", str(config), "--out", str(blocker / "run")], "cannot write there"),
        (["run", str(tmp_path)], "is a directory"),
        (["run", str(config), "engine.round_timeout_s=-5"], "engine.round_timeout_s"),
    ):
        proc = rayfl(*args)
        assert proc.returncode == 2, proc.stderr
        assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def _result(rejected, clients=6.0):
    cfg = build_config(SYNTHETIC)
    rows = [
        {"round": float(r), "clients": clients, "server/rejected": x, "time/round_s": 1.0}
        for r, x in enumerate(rejected, 1)
    ]
    return RunResult(cfg, history=rows)


def test_the_final_table_counts_rejected_replies_and_warns_above_half(
    monkeypatch, capsys, tmp_path
):
    table = cli.final_table(_result([2.0, 3.0]), 1.0)
    assert any(
        line.split() == ["server/rejected", "5", "of", "12", "replies"]
        for line in table.splitlines()
    )
    config = write_config(tmp_path, {})
    for rejected, warned in (([2.0, 3.0], False), ([4.0, 3.0], True)):
        monkeypatch.setattr(cli, "simulate", lambda *a, r=rejected, **k: _result(r))
        assert cli.main(["run", str(config), "--out", str(tmp_path / "o")]) == 0
        err = capsys.readouterr().err
        assert ("rejected 7 of 12 replies" in err) is warned


def test_ls_runs_lists_run_directories(tmp_path, capsys):
    run = tmp_path / "runs" / "one"
    run.mkdir(parents=True)
    gate.write(run / "config.yaml", b"{}")  # as rayfl writes them
    summary = {"status": "FINISHED", "rounds": 3, "final": {"personal/acc": 0.75}}
    gate.write(run / "summary.json", json.dumps(summary).encode())
    assert cli.main(["ls-runs", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert "one" in out and "FINISHED" in out and "0.7500" in out
