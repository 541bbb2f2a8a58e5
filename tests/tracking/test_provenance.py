"""MLflow runs say who ran what from where: user, command line, git commit, rayfl version, the
data as dataset inputs, a descriptive name; no bookkeeping keys as params. Real SQLite store."""

import subprocess
from pathlib import Path

import pytest

import rayfl
from rayfl.config import build_config
from rayfl.tracking.provenance import run_name_for, tracked_params
from tests.conftest import SYNTHETIC

ROOT = Path(__file__).resolve().parents[2]


def test_run_names_describe_the_run():
    cfg = build_config(SYNTHETIC, ["algorithm.T=4", "algorithm.alpha=0.1", "seed=3"])
    assert run_name_for(cfg) == "pfedes-kd-T4-a0.1-s3"
    cfg = build_config(SYNTHETIC, ["algorithm.beta=0.5", "algorithm.embed_dim=64"])
    assert run_name_for(cfg) == "pfedes-kd-T2-a0.5-b0.5-ed64-s0"
    assert run_name_for(build_config(SYNTHETIC, ["algorithm.name=local"])) == "local-s0"


def test_bookkeeping_keys_are_not_params():
    flat = {"name": "x", "tracking.run_name": "r", "tracking.uri": "u", "seed": 0, "data.x": 1}
    assert tracked_params(flat) == {"seed": 0, "data.x": 1}


@pytest.fixture
def tracked_run(tmp_path, monkeypatch, mlflow_uri):
    from rayfl.launch import simulate

    monkeypatch.setenv("RAYFL_COMMAND", "rayfl run exp.yaml engine.rounds=2")
    uri = mlflow_uri
    over = ["tracking.backend=mlflow", f"tracking.uri={uri}", "tracking.experiment=prov"]
    parent = simulate(build_config(SYNTHETIC, over), tmp_path / "a", progress=False)
    child = simulate(
        build_config(SYNTHETIC, [*over, "tracking.run_name=mine"]),
        tmp_path / "b",
        progress=False,
        parent_run_id=parent.tracker_run_id,
    )
    return uri, parent.tracker_run_id, child.tracker_run_id


@pytest.mark.slow
def test_mlflow_run_carries_provenance(tracked_run):
    from mlflow import MlflowClient

    uri, run_id, child_id = tracked_run
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    tags = run.data.tags
    assert run.info.run_name == "pfedes-kd-T2-a0.5-s0"
    assert tags["mlflow.user"] and tags["mlflow.user"] != "-"
    assert tags["mlflow.source.name"] == "rayfl run exp.yaml engine.rounds=2"
    assert tags["mlflow.source.type"] == "LOCAL"
    assert tags["rayfl.version"] == rayfl.__version__
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert tags["mlflow.source.git.commit"] == head
    params = run.data.params
    assert "algorithm.T" in params and "data.num_clients" in params
    assert not [k for k in params if k.startswith("tracking.") or k in ("name", "clients")]
    assert "clients" not in run.data.metrics and "personal/acc" in run.data.metrics
    inputs = {
        {t.key: t.value for t in d.tags}["mlflow.data.context"]: d.dataset
        for d in run.inputs.dataset_inputs
    }
    assert set(inputs) == {"train", "test"}
    assert inputs["train"].name == "synthetic-clients-600" and len(inputs["train"].digest) >= 8
    assert inputs["test"].digest != inputs["train"].digest
    child = client.get_run(child_id)
    assert child.info.run_name == "mine"  # tracking.run_name wins
    assert child.data.tags["mlflow.parentRunId"] == run_id  # children keep the parent link
    assert child.data.tags["mlflow.source.name"] == tags["mlflow.source.name"]
