"""MLflow across crashes: a resume continues the same run; a fresh SQLite store opened by two
processes at once works for both."""

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rayfl.tracking.mlflow import MlflowTracker
from tests.conftest import SYNTHETIC
from tests.interrupts import InterruptAfterRound

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_mlflow_run(tmp_path, mlflow_uri):
    from mlflow import MlflowClient

    from rayfl.config import build_config
    from rayfl.engine.rundir import read_mlflow_run
    from rayfl.launch import simulate

    uri = mlflow_uri
    track = ["tracking.backend=mlflow", f"tracking.uri={uri}", "tracking.experiment=resume"]
    out = tmp_path / "run"
    first = simulate(
        build_config(SYNTHETIC, [*track, "engine.rounds=2", "engine.checkpoint_every=1"]),
        out,
        progress=False,
    )
    assert read_mlflow_run(out)["run_id"] == first.tracker_run_id
    # a killed driver leaves its MLflow run RUNNING: the resume marks it, then continues it
    client = MlflowClient(uri)
    client.update_run(first.tracker_run_id, status="RUNNING")
    again = simulate(
        build_config(SYNTHETIC, [*track, "engine.rounds=3", "engine.checkpoint_every=1"]),
        out,
        progress=False,
        resume=True,
    )
    assert again.tracker_run_id == first.tracker_run_id
    (run,) = client.search_runs([client.get_experiment_by_name("resume").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["rayfl.resumes"] == "1"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "personal/acc")]
    assert steps == [1, 2, 3]


SCRIPT = textwrap.dedent(
    """
    import sys, time
    start, uri, name = float(sys.argv[1]), sys.argv[2], sys.argv[3]
    import mlflow  # import first: the race is in opening the store
    from rayfl.tracking.mlflow import MlflowTracker
    time.sleep(max(0.0, start - time.time()))
    t = MlflowTracker(experiment="race", tracking_uri=uri, run_name=name)
    t.log_metrics({"x": 1.0}, step=1)
    t.close()
    print("ok", t.run_id)
    """
)


@pytest.mark.slow
def test_two_processes_creating_one_fresh_sqlite_store_both_succeed(tmp_path):
    uri = f"sqlite:///{tmp_path}/fresh/mlflow.db"
    start = time.time() + 8.0  # both processes have imported mlflow by then
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(start), uri, f"p{i}"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-2000:]
        assert out.startswith("ok ")
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("race").experiment_id])
    assert sorted(r.info.run_name for r in runs) == ["p0", "p1"]


def test_mark_killed_only_touches_running_runs(tmp_path, mlflow_uri):
    from mlflow import MlflowClient

    from rayfl.tracking.mlflow import mark_killed

    uri = mlflow_uri
    alive = MlflowTracker(experiment="k", tracking_uri=uri)
    done = MlflowTracker(experiment="k", tracking_uri=uri)
    done.close("FINISHED")
    assert mark_killed(alive.run_id, uri) and not mark_killed(done.run_id, uri)
    client = MlflowClient(uri)
    assert client.get_run(alive.run_id).info.status == "KILLED"
    assert client.get_run(done.run_id).info.status == "FINISHED"


@pytest.mark.slow
def test_a_resume_relogs_the_rounds_mlflow_missed(tmp_path, mlflow_uri):
    import pytest
    from mlflow import MlflowClient

    from rayfl.config import build_config
    from rayfl.launch import simulate

    uri = mlflow_uri
    track = ["tracking.backend=mlflow", f"tracking.uri={uri}", "tracking.experiment=relog"]
    out = tmp_path / "run"
    cfg = build_config(SYNTHETIC, [*track, "engine.rounds=4", "engine.checkpoint_every=1"])
    with pytest.raises(KeyboardInterrupt):
        simulate(cfg, out, progress=False, extra_callbacks=[InterruptAfterRound(at=2)])
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("relog").experiment_id])
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "personal/acc")]
    assert steps == [1]  # round 2 is in the checkpoint, not in MLflow
    simulate(cfg, out, progress=False, resume=True)
    for key in ("personal/acc", "comm/bytes_up"):
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
        assert steps == [1, 2, 3, 4], key


@pytest.mark.slow
def test_a_failed_run_ends_its_mlflow_run_failed_with_the_error(tmp_path, mlflow_uri):
    import json

    import pytest
    from mlflow import MlflowClient

    from rayfl.config import build_config
    from rayfl.engine.callbacks import Callback
    from rayfl.launch import simulate

    class Boom(Callback):
        def on_round_end(self, sim, round_idx, metrics):
            raise RuntimeError("disk on fire")

    uri = mlflow_uri
    track = ["tracking.backend=mlflow", f"tracking.uri={uri}", "tracking.experiment=failed"]
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="disk on fire"):
        simulate(build_config(SYNTHETIC, track), out, progress=False, extra_callbacks=[Boom()])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "FAILED" and summary["error"] == "RuntimeError: disk on fire"
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("failed").experiment_id])
    assert run.info.status == "FAILED"
    assert run.data.tags["rayfl.error"] == "RuntimeError: disk on fire"
