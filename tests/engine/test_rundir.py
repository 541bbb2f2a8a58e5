"""The run directory: locked, checked before work, strict JSON, untouched by a failed resume,
listed (and killed runs marked) by `rayfl ls-runs`."""

import json
import math
import subprocess
import sys

import pytest

from rayfl import gate
from rayfl.config import build_config
from rayfl.engine.callbacks import RunDirectory
from rayfl.engine.loop import RunResult
from rayfl.engine.rundir import (
    RunLock,
    check_writable,
    list_runs,
    strict_json,
    write_mlflow_run,
)
from rayfl.errors import UserError
from rayfl.launch import simulate


def test_strict_json_writes_null_for_nan_and_inf():
    text = strict_json({"a": math.nan, "b": [1.0, math.inf], "c": {"d": -math.inf, "e": 2}})
    assert json.loads(text) == {"a": None, "b": [1.0, None], "c": {"d": None, "e": 2}}


class _Sim:
    def __init__(self, cfg, history):
        self.cfg = cfg
        self.result = RunResult(cfg, history=history)

    def wall_s(self):
        return 1.0


def test_summary_json_is_strict_even_with_nan_metrics(synthetic_raw, tmp_path):
    cfg = build_config(synthetic_raw)
    out = RunDirectory(tmp_path)
    out.run_dir.mkdir(exist_ok=True)
    out._opened = True
    out.write_summary(_Sim(cfg, [{"round": 1.0, "proxy/acc": math.nan}]), "FINISHED")
    text = (tmp_path / "summary.json").read_text()
    assert "NaN" not in text
    summary = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert summary["final"]["proxy/acc"] is None


@pytest.mark.slow
def test_a_second_run_on_the_same_directory_stops_naming_the_owner(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from rayfl.engine.rundir import RunLock;"
            "RunLock(Path(sys.argv[1])).acquire(); print('locked', flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError, match=rf"in use by another rayfl run \(pid {holder.pid}\)"):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    # the kernel releases the lock of a killed process: the directory is free again
    with RunLock(tmp_path):
        pass


@pytest.mark.slow
def test_out_is_checked_before_any_work(tmp_path, synthetic_raw):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(UserError, match="cannot write there"):
        check_writable(blocker / "run")
    # data that could not even be loaded: the --out error comes first
    raw = dict(
        synthetic_raw, data={**synthetic_raw["data"], "dataset": "fmnist", "root": "/nonexistent"}
    )
    with pytest.raises(UserError, match=r"--out .*cannot write there"):
        simulate(build_config(raw), blocker / "run", progress=False)


@pytest.mark.slow
def test_a_failed_resume_leaves_summary_and_metrics_alone(synthetic_raw, tmp_path):
    cfg = build_config(synthetic_raw, ["engine.checkpoint_every=0"])
    simulate(cfg, tmp_path, progress=False)
    before = {n: (tmp_path / n).read_bytes() for n in ("summary.json", "metrics.parquet")}
    with pytest.raises(UserError, match="no checkpoint"):
        simulate(cfg, tmp_path, progress=False, resume=True)
    after = {n: (tmp_path / n).read_bytes() for n in ("summary.json", "metrics.parquet")}
    assert after == before


@pytest.mark.slow
def test_ls_runs_marks_a_killed_run_killed_here_and_in_mlflow(tmp_path, monkeypatch, mlflow_uri):
    from mlflow import MlflowClient

    from rayfl.tracking.mlflow import MlflowTracker

    uri = mlflow_uri
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # the user's own store
    tracker = MlflowTracker(experiment="ls", tracking_uri=uri)  # never closed: a killed driver
    runs = tmp_path / "runs"
    killed, done = runs / "a", runs / "b"
    for path, status in ((killed, "RUNNING"), (done, "FINISHED")):
        path.mkdir(parents=True)
        gate.write(path / "config.yaml", b"{}")  # as rayfl writes them (rayfl.gate)
        summary = {"status": status, "rounds": 2, "final": {"personal/acc": 0.5}}
        gate.write(path / "summary.json", json.dumps(summary).encode())
    write_mlflow_run(killed, tracker.run_id, uri)
    infos = {p.path.name: p for p in list_runs(runs)}
    assert infos["a"].status == "KILLED" and infos["b"].status == "FINISHED"
    assert infos["b"].rounds == 2 and infos["b"].metric == 0.5
    assert json.loads((killed / "summary.json").read_text())["status"] == "KILLED"
    assert MlflowClient(uri).get_run(tracker.run_id).info.status == "KILLED"
    # a run whose lock is held is RUNNING, with its owner
    with RunLock(done):
        pass
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from rayfl.engine.rundir import RunLock;"
            "RunLock(Path(sys.argv[1])).acquire(); print('locked', flush=True); time.sleep(60)",
            str(done),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        (info,) = [i for i in list_runs(runs) if i.path.name == "b"]
        assert info.status == "RUNNING" and info.owner == holder.pid
    finally:
        holder.kill()
        holder.wait()


def test_ls_runs_never_contacts_a_tracking_uri_named_by_the_run_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mine.db")
    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    gate.write(run / "config.yaml", b"{}")
    gate.write(run / "summary.json", json.dumps({"status": "RUNNING", "rounds": 1}).encode())
    elsewhere = tmp_path / "elsewhere" / "planted.db"
    elsewhere.parent.mkdir()
    write_mlflow_run(run, "0123abcd", f"sqlite:///{elsewhere}")
    (info,) = list_runs(tmp_path / "runs")
    assert info.status == "KILLED"
    assert not elsewhere.exists() and not (tmp_path / "mine.db").exists()
