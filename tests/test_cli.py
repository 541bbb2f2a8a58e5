"""`rayfl` end to end in a subprocess: run with MLflow tracking, ls, validate."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import SYNTHETIC

pytestmark = pytest.mark.slow  # end-to-end runs, subprocesses or Ray

ROOT = Path(__file__).resolve().parents[1]


def rayfl(*args, cwd=ROOT, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "rayfl.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_run_logs_to_mlflow_and_writes_the_run_directory(tmp_path, mlflow_uri):
    from mlflow import MlflowClient

    cfg = tmp_path / "exp.yaml"
    cfg.write_text(yaml.safe_dump(SYNTHETIC))
    uri = mlflow_uri
    out = tmp_path / "run"
    proc = rayfl(
        "run",
        str(cfg),
        "tracking.backend=mlflow",
        f"tracking.uri={uri}",
        "tracking.experiment=cli",
        "--out",
        str(out),
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr
    assert "personal/acc/arch=tiny_a" in proc.stdout and "proxy/acc" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "FINISHED" and summary["rounds"] == 2
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("cli")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "personal/acc")
    assert [m.step for m in history] == [1, 2]
    assert abs(history[-1].value - summary["final"]["personal/acc"]) < 1e-9
    assert run.data.params["algorithm.name"] == "pfedes"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {
        "metrics.parquet",
        "summary.json",
        "learning_curves.png",
        "label_distribution.png",
    } <= artifacts


def test_ls_lists_every_registry():
    proc = rayfl("ls")
    assert proc.returncode == 0, proc.stderr
    for word in (
        "pfedes",
        "fedavg",
        "local",
        "cnn_small",
        "seed3",
        "cnn5",
        "fmnist",
        "dirichlet",
        "pathological",
    ):
        assert word in proc.stdout


def test_validate_main_job():
    proc = rayfl("validate", "experiments/pfedes_fmnist.yaml")
    assert proc.returncode == 0, proc.stderr
    assert "pfedes on fmnist, 20 clients, 3 architectures" in proc.stdout
